"""The schedule inside ``torch.compile`` (``offload.executor.compiled``): the compiled graph's
forward nodes in the chain's stages, the recomputed stages' ops run again in its backward,
gradients bit for bit those of plain ``torch.compile`` (dropout on)."""
import copy
import re
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from offload.errors import ChainMismatch
from offload.executor import Offloaded
from offload.executor.checks import compiled_reference
from offload.executor.compiled import SchedulePartitioner, compile_scheduled, module_path, plain_compile
from offload.executor.graph_copies import D2H_OP, H2D_OP, OPS, RELEASE_OP, WAIT_OP
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.step.actions import Offload, Recompute, first_checkpoint_release
from offload.step.chain import MATMULS, StageOption
from offload.step.memory import floor_offloads, no_offload_peak
from offload.step.recompute import run_op
from offload.step.schedule import make_schedule

GPT = {"layers": 4, "width": 32, "heads": 4, "seq": 16, "vocab": 64, "dropout": 0.1}
MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


@pytest.fixture(scope="module")
def chain():
    return profile("gpt", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options=GPT)).chain


def step(make):
    """One training step of the GPT (same weights, same dropout draws each time): the module
    ``make`` returns and the gradients.  Dynamo's caches are emptied first: each test
    compiles the same ``forward`` again, past its limit of recompilations."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    spec = resolve("gpt", 2, GPT)
    run = make(spec.module)
    torch.manual_seed(0)
    spec.loss(run(*spec.args)).backward()
    return run, [p.grad.clone() for p in spec.module.parameters()]


def matmuls(gm):
    return sum(1 for n in gm.graph.nodes if n.target in MATMUL_OPS)


def saved(gm):
    """How many values the forward graph hands the backward."""
    return len(list(gm.graph.nodes)[-1].args[0])


def test_module_paths_as_named_modules_writes_them():
    assert module_path("L['self'].h[2].mlp") == "h.2.mlp"
    assert module_path("L['self']._modules['h']._modules['0'].attn") == "h.0.attn"
    assert module_path("L['self']") == ""


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_recomputed_stages_run_again_in_the_backward_bit_for_bit(chain, backend):
    runs = [Recompute(i, i) for i in sorted(chain.recomputable)[1::2]]
    assert runs
    _, plain = step(lambda m: torch.compile(m, backend=backend))
    kept, kept_grads = step(lambda m: compile_scheduled(m, chain, make_schedule(chain, []), backend=backend))
    ours, grads = step(lambda m: compile_scheduled(m, chain, make_schedule(chain, [], recompute=runs), backend=backend))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads)) and all(torch.equal(a, b) for a, b in zip(plain, kept_grads))
    p = ours.partitioner
    order = list(p.stages.values())
    assert order == sorted(order) and set(order) == set(range(1, chain.L + 1))  # every stage, in order
    recomputed = {k for r in runs for k in range(r.first, r.last + 1)}
    # a kept stage's node is the partitioner's choice, but for a value a recomputed run reads (its
    # input, the checkpoint), saved as it is: not made again in the backward from what the kept
    # stage saves, which would then save more than with the run kept
    assert {p.tags[n] for n, k in p.stages.items() if k not in recomputed} == {None, CheckpointPolicy.MUST_SAVE}
    assert all(any(p.tags[n] == CheckpointPolicy.MUST_SAVE for n, k in p.stages.items() if k == r.first - 1)
               for r in runs if r.first - 1 not in recomputed)
    # every recomputed stage re-runs something, but the final norm: the head reads its output,
    # and a layer norm's outputs are one op's, saved with it
    assert all(any(p.tags[n] == CheckpointPolicy.MUST_RECOMPUTE for n, k in p.stages.items() if k == j)
               for j in recomputed if chain.stage(j).name != "ln_f")
    (fw_kept, bw_kept), (fw, bw) = kept.partitioner.graphs, p.graphs
    assert matmuls(bw) > matmuls(bw_kept) and saved(fw) < saved(fw_kept)  # the blocks' matmuls again, fewer saved
    before, after = kept.partitioner.saved_bytes(), p.saved_bytes()
    assert set(before) <= set(range(chain.L + 1)) and all(after.get(j, 0) < before[j] for j in recomputed)


def test_a_recomputed_run_holds_its_input_and_hands_its_output_on(chain):
    """As the eager executor runs a run: its input is its checkpoint, not a unit of the stage
    before (offloaded with it, it was fetched back late for the rebuild); an offloaded
    checkpoint moves activations, never the weights the run reads (the module holds them);
    what the next, kept stage reads of the run is saved for that stage, so the run is rebuilt
    in its own backward, not in that stage's."""
    names = [s.name for s in chain.stages]
    k = names.index("h.2") + 1
    assert {k - 1, k} <= chain.recomputable and k < chain.L  # stage k + 1 kept: the run is k alone
    run = Recompute(k, k)
    moving = replace(run, release=first_checkpoint_release(chain, run), prefetch=run_op(chain, run))
    _, plain = step(lambda m: torch.compile(m, backend="aot_eager"))
    for offloads, runs in (([Offload(k - 1, k, k)], [run]), ([], [moving])):
        ours, grads = step(lambda m: compile_scheduled(m, chain, make_schedule(chain, offloads, runs),
                                                       backend="aot_eager"))
        assert all(torch.equal(a, b) for a, b in zip(plain, grads))
        p = ours.partitioner
        assert p.placed.late == []  # every value is back where the schedule says, the run's input too
        moved = [v for s in p.placed.storages for v in s.values]
        assert moved and all(v.op == "call_function" for v in moved)  # no weight
        _, backward = p.graphs
        order = [n.name for n in backward.graph.nodes if n.op == "call_function"]
        rebuilt = [i for i, n in enumerate(order) if p.stages.get(n) == k]
        first = min(i for i, n in enumerate(order) if p.back_stages.get(n) == k)
        later = [i for i, n in enumerate(order) if p.back_stages.get(n, 0) > k and i < first]
        assert rebuilt and max(later) < min(rebuilt)  # after B(k+1)'s nodes


@pytest.mark.slow
def test_an_in_stage_option_keeps_its_matmuls_in_the_graph(chain):
    """``Recompute(i, i, "matmuls")``: the stage's matmul outputs are saved, the rest of it is
    recomputed (the eager executor's ``KeepRule``), gradients still bit for bit.  (A GPT this
    small offers no option on a CPU, where the option's dispatch costs more than it spares:
    the stage offers it here as a larger model's profile would.)"""
    i = sorted(chain.recomputable)[1]
    s = chain.stage(i)
    chain = replace(chain, stages=tuple(replace(t, options=(StageOption(MATMULS, s.saved_bytes // 2, s.fwd_s / 2),))
                                        if t is s else t for t in chain.stages))
    _, plain = step(lambda m: torch.compile(m, backend="aot_eager"))
    whole, _ = step(lambda m: compile_scheduled(m, chain, make_schedule(chain, [], recompute=[Recompute(i, i)]),
                                                backend="aot_eager"))
    part, grads = step(lambda m: compile_scheduled(m, chain, make_schedule(chain, [], recompute=[Recompute(i, i, MATMULS)]),
                                                   backend="aot_eager"))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    p = part.partitioner
    tags = [p.tags[n] for n, k in p.stages.items() if k == i]
    assert CheckpointPolicy.MUST_SAVE in tags and CheckpointPolicy.MUST_RECOMPUTE in tags
    assert matmuls(p.graphs[1]) < matmuls(whole.partitioner.graphs[1])  # fewer matmuls run again


@pytest.mark.slow
def test_offloaded_units_go_to_the_host_where_pytorch_places_them(chain):
    """``copies="pytorch"``, the baseline: the units the schedule offloads, marked in the joint
    graph, PyTorch's offloading puts their saved tensors' copies in the forward graph and the
    reloads in the backward one (``device_put``: on the CPU a copy to the CPU), gradients bit
    for bit, and what it moved of each unit is said."""
    offloads = floor_offloads(chain)[1::2]
    _, plain = step(lambda m: torch.compile(m, backend="aot_eager"))
    with pytest.warns(UserWarning, match=r"moves U\d+ \(.* stay\).* only in part"):  # the getitems and views it skips
        ours, grads = step(lambda m: compile_scheduled(m, chain, make_schedule(chain, offloads), backend="aot_eager",
                                                       copies="pytorch"))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    p = ours.partitioner
    fw, bw = p.graphs
    puts = [n for n in fw.graph.nodes if n.target == torch.ops.prims.device_put.default]
    assert puts and {p.units[n.args[0].name] for n in puts} == {o.stage for o in offloads}
    assert sum(1 for n in bw.graph.nodes if n.target == torch.ops.prims.device_put.default) == len(puts)
    assert set(p.moved) == {o.stage for o in offloads} and all(moved > 0 for moved, _ in p.moved.values())


@pytest.mark.slow
def test_pytorch_offloads_the_matmuls_outputs_when_asked(chain):
    """``copies="pytorch-matmuls"``, the second baseline: every matmul's output marked, PyTorch's
    pass copies those it can to the host, gradients bit for bit; a schedule's offloads are
    refused there."""
    _, plain = step(lambda m: torch.compile(m, backend="aot_eager"))
    ours, grads = step(lambda m: compile_scheduled(m, chain, make_schedule(chain, []), backend="aot_eager",
                                                   copies="pytorch-matmuls"))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    p = ours.partitioner
    puts = [n for n in p.graphs[0].graph.nodes if n.target == torch.ops.prims.device_put.default]
    assert puts and all(n.args[0].target in MATMUL_OPS for n in puts) and p.host_bytes() > 0
    with pytest.raises(ChainMismatch, match="offloads the matmuls' outputs, not a schedule's units"):
        SchedulePartitioner(chain, make_schedule(chain, floor_offloads(chain)[:1]), copies="pytorch-matmuls")


def spread(chain):
    """Offloads released and fetched at several points: every other unit kept on the device
    until the turn and fetched at once, the others released at once and fetched just in time."""
    return [Offload(i, chain.L, chain.L) if n % 2 else Offload(i, i + 1, int(chain.need[i]))
            for n, i in enumerate(sorted(chain.offloadable))]


def positions(graph):
    return {n: i for i, n in enumerate(graph.nodes)}


def test_our_copies_sit_at_the_schedules_events(chain):
    """``copies="schedule"``: in the forward graph each unit's D2H ops come after the last node of
    its stage and before the next stage's first, the releases after the last node of their
    point's stage (at ``L``: before the output); in the backward graph the H2D ops of point
    ``k`` after ``B(k+1)``'s last node and before ``Bk``'s first, the waits before the first
    node of ``B(need)``, after every prefetch of their point; each unit moved whole, read
    nowhere before its point, and the ops in the events' order."""
    offloads = spread(chain)
    ours, _ = step(lambda m: compile_scheduled(m, chain, make_schedule(chain, offloads), backend="aot_eager"))
    p = ours.partitioner
    fw, bw = p.graphs
    assert p.placed.late == [] and all(not stay for stay in p.placed.stay.values())
    assert set(p.moved) == {o.stage for o in offloads} and all(left == 0 for _, left in p.moved.values())
    at = positions(fw.graph)
    staged = [n for n in fw.graph.nodes if n.name in p.stages]
    first = {k: min(at[n] for n in staged if p.stages[n.name] == k) for k in range(1, chain.L + 1)}
    last = {k: max(at[n] for n in staged if p.stages[n.name] == k) for k in range(1, chain.L + 1)}
    output = at[fw.graph.find_nodes(op="output")[0]]
    ops = {op: [n for n in fw.graph.nodes if n.target is op] for op in (D2H_OP, RELEASE_OP)}
    for o in offloads:
        copies = [n for n in ops[D2H_OP] if p.units[n.args[0][0].name] == o.stage]
        releases = [n for n in ops[RELEASE_OP] if p.units[n.args[1].name] == o.stage]
        assert copies and len(copies) == len(releases) == len(p.placed.moved[o.stage])
        assert all(last[o.stage] < at[n] < first[o.stage + 1] for n in copies)
        end = output if o.release == chain.L else first[o.release + 1]
        assert all(last[o.release] < at[n] < end for n in releases)
    keys = [n.args[4] for n in ops[D2H_OP]]
    assert keys == sorted(keys) == list(range(len(keys)))  # issued in forward order, one slot each
    at = positions(bw.graph)
    begins = {}  # stage -> where the backward graph starts running its backward
    for n in bw.graph.nodes:
        if n.op == "call_function" and n.name in p.back_stages:
            begins.setdefault(p.back_stages[n.name], at[n])
    h2d = {n.args[3]: n for n in bw.graph.nodes if n.target is H2D_OP}
    wait = {n.args[2]: n for n in bw.graph.nodes if n.target is WAIT_OP}
    assert set(h2d) == set(wait) == set(keys)
    for o in offloads:
        mine = [k for k, n in h2d.items() if p.units[n.args[0].name] == o.stage]
        need = int(chain.need[o.stage])
        assert len(mine) == len(p.placed.moved[o.stage])
        for k in mine:
            assert begins.get(o.prefetch + 1, -1) < at[h2d[k]] < at[wait[k]] < begins[need]
            assert need == chain.L or begins[need + 1] < at[wait[k]]
            assert all(at[wait[k]] < at[u] for u in wait[k].users)


LLAMA = {"layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "seq": 32, "vocab": 128, "dropout": 0.1}


@pytest.mark.slow  # make test-all (time): make test keeps the GPT's copies, recomputation and checkpoints
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_our_copies_keep_a_llamas_gradients_bit_for_bit_and_move_its_units_whole(backend):
    """transformers' Llama (SDPA, grouped-query attention, dropout) on the lazy CPU backend (a
    buffer read before its copy is waited for reads poison), a recomputed layer offloading its
    checkpoint beside the offloads: gradients those of plain compile, every unit moved whole,
    the checkpoint's input moved (the rotary table the other layers read too stays), each
    way, in the same slots every step; the attention's transposes the partitioner made at the
    forward's end are moved with their unit.  Under Inductor the gradients are those of the
    reference ``offload train --check-grads`` compiles (``compiled_reference``): the same
    compile recomputing the same layer, nothing moved; Inductor fuses a recomputed block's
    kernels otherwise than the forward's, which changes the gradients by rounding (2e-7
    relative on this Llama against plain compile, copies or not; bit for bit on the GPT
    above).  Every moved value is laid out as the graph says (Inductor laid some saved
    views of this Llama out otherwise, for the copies to put back in buffers no chain counts,
    until the forward realized them at the graph's strides): nothing is relaid."""
    llama = profile("llama", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options=LLAMA)).chain
    i = sorted(llama.recomputable)[1]
    run = Recompute(i, i)
    run = replace(run, release=first_checkpoint_release(llama, run), prefetch=run_op(llama, run))
    runs = [run]
    offloads = [o for o in spread(llama) if all(not r.first <= o.stage <= r.last for r in runs)]
    schedule = make_schedule(llama, offloads, recompute=runs)
    reference, _ = compiled_reference(llama, schedule, backend)
    assert reference.recompute == (tuple(runs) if backend == "inductor" else ()) and not reference.offloads

    def grads(make):
        torch._dynamo.reset()
        torch.manual_seed(1)
        spec = resolve("llama", 2, LLAMA)
        run = make(spec.module)
        for seed in (0, 1):
            torch.manual_seed(seed)
            spec.loss(run(*spec.args, **spec.kwargs)).backward()
        return run, [p.grad.clone() for p in spec.module.parameters()]
    if reference.recompute:
        _, plain = grads(lambda m: compile_scheduled(m, llama, reference, backend=backend))
    else:
        _, plain = grads(lambda m: torch.compile(m, backend=backend))
    ours, theirs = grads(lambda m: compile_scheduled(m, llama, schedule, backend=backend, copy_backend="cpu-lazy"))
    assert all(torch.equal(a, b) for a, b in zip(plain, theirs))
    p = ours.partitioner
    assert set(p.moved) == {o.stage for o in offloads} and all(left == 0 for _, left in p.moved.values())
    assert any(name not in p.stages and p.units[name] in p.moved  # a backward op the forward graph makes
               for values in p.placed.moved.values() for names in values.values() for name in names)
    assert all(p.placed.checkpoints[r.first] and p.placed.checkpoint_bytes[r.first]
               >= llama.stage(r.first).input_own_bytes > 0 for r in runs)
    runtime = p.runtime
    assert runtime.d2h_bytes == runtime.h2d_bytes == 2 * runtime.planned_bytes > 0
    assert runtime.planned_bytes == sum(p.placed.moved_bytes.values()) + sum(p.placed.checkpoint_bytes.values())
    assert runtime.backend.name == "cpu-lazy" and runtime.arena.allocations == 1
    assert runtime.relaid == 0


@pytest.mark.slow
def test_inductor_keeps_our_copies_where_they_were_placed(chain):
    """Inductor orders a graph's nodes by their dependencies only: each copy op's ``after`` inputs
    keep it from running before its event, and with Inductor's peak-memory reordering off
    (``compile_scheduled``'s default) nothing runs it later: the generated code calls the ops
    in the order they were placed, and the gradients (lazy backend) are plain compile's."""
    from torch._inductor.utils import run_and_get_code

    runs = [Recompute(i, i) for i in sorted(chain.recomputable)[::3]]
    offloads = [o for o in spread(chain) if all(not r.first <= o.stage <= r.last for r in runs)]
    schedule = make_schedule(chain, offloads, recompute=runs)
    _, plain = step(lambda m: torch.compile(m, backend="inductor"))
    made = {}

    def make(m):
        made["run"] = compile_scheduled(m, chain, schedule, backend="inductor", copy_backend="cpu-lazy")
        return made["run"]
    (_, grads), (forward, backward) = run_and_get_code(lambda: step(make))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    fw, bw = made["run"].partitioner.graphs

    def issued(code):
        """(op, key) of each copy op the generated code calls, in order."""
        return [(m[1], int(m[2])) for m in re.finditer(
            r"torch\.ops\.offload\.(\w+)\.default\(.*, \d+, (\d+), \[.*\]\)$", code, re.M)]

    def placed(graph):
        return [(n.target._opname, n.args[-2]) for n in graph.nodes if n.target in OPS]
    assert issued(forward) == list(placed(fw.graph)) and issued(backward) == list(placed(bw.graph))


def test_what_a_compiled_graph_cannot_run_is_refused(chain):
    encoded = replace(make_schedule(chain, []), encode={2: "lossless"})
    with pytest.raises(ChainMismatch, match="runs no encoder, and this schedule encodes U2"):
        SchedulePartitioner(chain, encoded)
    i = next(i for i in sorted(chain.recomputable) if chain.stage(i).input_own_bytes)
    moved = make_schedule(chain, [], [Recompute(i, i, release=chain.L, prefetch=chain.L)])
    with pytest.raises(ChainMismatch, match=rf"moves no recomputed run's checkpoint, .* those of {i} \(checkpoint"):
        SchedulePartitioner(chain, moved, copies="pytorch")
    wrapped = resolve("gpt", 2, GPT).module
    Offloaded(wrapped, chain, make_schedule(chain, []))
    with pytest.raises(ChainMismatch, match="inside an Offloaded: its stage boundaries break a compiled graph"):
        compile_scheduled(wrapped, chain, make_schedule(chain, []))
    with pytest.raises(ChainMismatch, match="no submodule 'wte'"):
        compile_scheduled(resolve("mlp", 2, {"layers": 2, "width": 8, "features": 4, "classes": 3}).module, chain,
                          make_schedule(chain, []))


def test_a_budget_is_said_not_to_be_a_promise_in_a_compiled_graph(chain):
    """A schedule solved for a budget: the budget is the eager chain's, and the compiled step's
    memory is not predicted yet (on a GPT the joint schedule held 1.5x its budget compiled,
    experiments/results/README.md), so the user is told."""
    from offload.step.budget import Budget

    solved = make_schedule(chain, floor_offloads(chain)[:1], budget=Budget(no_offload_peak(chain) // 2))
    with pytest.warns(UserWarning, match="the budget is not a promise here"):
        compile_scheduled(resolve("gpt", 2, GPT).module, chain, solved, backend="aot_eager")


def test_the_compile_cache_key_follows_the_schedule(chain):
    a, b = (make_schedule(chain, [], recompute=[Recompute(i, i)]) for i in sorted(chain.recomputable)[:2])
    moving = make_schedule(chain, floor_offloads(chain)[:1], recompute=a.recompute)
    one = SchedulePartitioner(chain, a)
    assert one.uuid() == one.uuid()
    assert len({SchedulePartitioner(chain, s).uuid() for s in (a, b, moving)} | {one.uuid()}) == 4
    # each partitioner's copy ops call its own runtime, by a number in the graph and in the key
    assert SchedulePartitioner(chain, a).runtime.number != one.runtime.number
    assert copy.deepcopy({"custom_partitioner_fn": one})["custom_partitioner_fn"] is one  # Inductor's snapshot


@pytest.mark.slow
def test_a_batch_norm_recomputed_in_the_graph_reads_its_statistics_as_saved():
    """A ResNet-18's blocks recomputed in the compiled graph: the batch norms' running
    statistics, updated after the forward, are not read again by a recomputation (its
    version check would fail), and the gradients are plain compile's."""
    chain = profile("resnet18", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options={"image": 32})).chain
    runs = [Recompute(i, i) for i in sorted(chain.recomputable)[1::2]]

    def grads(make):
        torch._dynamo.reset()
        torch.manual_seed(1)
        spec = resolve("resnet18", 2, {"image": 32})
        run = make(spec.module)
        spec.loss(run(*spec.args)).backward()
        return run, [p.grad.clone() for p in spec.module.parameters()]
    _, plain = grads(lambda m: torch.compile(m, backend="aot_eager"))
    ours, theirs = grads(lambda m: compile_scheduled(m, chain, make_schedule(chain, [], recompute=runs), backend="aot_eager"))
    assert all(torch.equal(a, b) for a, b in zip(plain, theirs))
    assert any(t == CheckpointPolicy.MUST_RECOMPUTE for t in ours.partitioner.tags.values())


def _joint(modules):
    """A joint graph of one forward node per module path (``None``: in no module) and a backward node."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for path in modules:
        x = graph.call_function(torch.ops.aten.relu.default, (x,))
        x.meta.update(partitioner_tag="is_forward", nn_module_stack={} if path is None else {path: (f"L['self'].{path}", None)})
    back = graph.call_function(torch.ops.aten.relu.default, (x,))
    back.meta["partitioner_tag"] = "is_backward"
    graph.output((back,))
    return graph


def test_stages_of_a_graph_and_graphs_a_break_made():
    """Stage ``k`` ends with the last node in the ``k``-th cut's module; a graph with none of the
    cuts (a break put it outside the stages) has no stages; one with some of them is refused."""
    from offload.core.staging import Site
    from offload.executor.compiled import assign_stages

    cuts = [Site("a"), Site("b")]
    stages = assign_stages(_joint(["a", "a", None, "b", "c", None]), cuts)
    assert list(stages.values()) == [1, 1, 2, 2, 3, 3]
    assert assign_stages(_joint(["c", None]), cuts) == {}
    with pytest.raises(ChainMismatch, match="runs some of the chain's cut sites but not 'b'"):
        assign_stages(_joint(["a", "c"]), cuts)
    # a cut at a call's start (``Site.before``: the code before the block ends the stage before)
    stages = assign_stages(_joint(["a", None, "b", "b", "c"]), [Site("a"), Site("b", before=True), Site("b")])
    assert list(stages.values()) == [1, 2, 3, 3, 4]


@pytest.mark.slow
def test_a_loss_compiled_apart_is_left_to_the_compiler():
    """transformers' GPT-2 computes its own loss, whose config warning breaks the graph: with
    ``fullgraph=False`` the model's graph holds every stage and runs the schedule, the loss's
    graph is compiled plainly (said), gradients those of plain compile."""
    opts = {"layers": 2, "width": 64, "heads": 4, "seq": 16}
    gpt2 = profile("gpt2", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options=opts)).chain
    runs = [Recompute(i, i) for i in sorted(gpt2.recomputable)[:2]]

    def grads(make):
        torch._dynamo.reset()
        torch.manual_seed(1)
        spec = resolve("gpt2", 2, opts)
        run = make(spec.module)
        torch.manual_seed(0)
        spec.loss(run(*spec.args, **spec.kwargs)).backward()
        return run, [p.grad.clone() for p in spec.module.parameters() if p.grad is not None]
    _, plain = grads(lambda m: torch.compile(m, backend="aot_eager"))
    with pytest.warns(UserWarning, match="runs none of the chain's stage boundaries"):
        ours, theirs = grads(lambda m: compile_scheduled(m, gpt2, make_schedule(gpt2, [], recompute=runs),
                                                         backend="aot_eager", fullgraph=False))
    assert all(torch.equal(a, b) for a, b in zip(plain, theirs))
    assert set(ours.partitioner.stages.values()) == set(range(1, gpt2.L + 1))


@pytest.mark.slow  # make test-all (time)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_skip_the_forward_reads_after_its_release_keeps_its_values(backend):
    """A U-Net's skip features: saved by a down block, released by the schedule, and read
    again by the up block's concatenation later in the forward (the graph holds them until
    then).  On the lazy CPU backend, which poisons what it is told is freed, the release must
    not poison them (it did under Inductor, when its copies of the U-Net's saved values were
    relaid: 2.5 relative off).  Gradients bit for bit those of the same compile without the
    schedule (``plain_compile``: under Inductor without its layout optimization, which laid
    the convolutions' values out channels last, for the copies to put back into the graph's
    layout in buffers no chain counted)."""
    model, options = "tests/models/unet.py:build", {"width": 8, "depth": 2, "image": 32}
    chain = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options=options)).chain
    assert any(chain.stage(o.stage).held_bytes for o in floor_offloads(chain))  # skips released, read again

    def grads(make):
        torch._dynamo.reset()
        spec = resolve(model, 2, options)
        run = make(spec.module)
        spec.loss(run(*spec.args)).backward()
        return run, [p.grad for p in spec.module.parameters()]
    _, plain = grads(lambda m: plain_compile(m, backend))
    staying = [replace(o, restore=0) for o in floor_offloads(chain)]  # a compiled graph's skips stay on the device
    ours, theirs = grads(lambda m: compile_scheduled(m, chain, make_schedule(chain, staying),
                                                     backend=backend, copy_backend="cpu-lazy"))
    assert all(torch.equal(a, b) for a, b in zip(plain, theirs))
    assert ours.partitioner.runtime.relaid == 0 and ours.partitioner.runtime.d2h_bytes > 0
    with pytest.raises(ChainMismatch, match="cannot take a held part off the device"):  # the floor restores them
        compile_scheduled(resolve(model, 2, options).module, chain, make_schedule(chain, floor_offloads(chain)),
                          backend=backend)


def test_a_prefetch_waits_for_the_gradient_sum_that_closes_the_stage_before():
    """transformers' BERT closes a layer's backward with the sum of its residual gradients,
    a node no ``seq_nr`` puts in a stage: the H2D copies of the next stage's point come after
    it (before it, each held its buffer through that sum: 311 KiB over a BERT op's
    prediction), so that only our ops and recomputed forward nodes stand between a prefetch
    and the stage it is issued for."""
    options = {"layers": 1, "width": 32, "heads": 2, "seq": 16, "vocab": 64}
    bert = profile("bert", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options=options)).chain
    torch._dynamo.reset()
    spec = resolve("bert", 2, options)
    run = compile_scheduled(spec.module, bert, make_schedule(bert, floor_offloads(bert)), backend="aot_eager",
                            copy_backend="cpu-lazy")
    spec.loss(run(*spec.args, **spec.kwargs)).backward()
    p = run.partitioner
    graph = p.graphs[1].graph
    at = positions(graph)
    begins = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.name in p.back_stages:
            begins.setdefault(p.back_stages[n.name], at[n])
    unstaged = [n for n in graph.nodes if n.op == "call_function" and n.name not in p.back_stages
                and n.target not in (H2D_OP, WAIT_OP, torch.ops.aten.as_strided.default) and n.name not in p.stages]
    assert unstaged  # the sums this test is about
    for h2d in (n for n in graph.nodes if n.target is H2D_OP):
        start = min(b for b in begins.values() if b > at[h2d])  # of the stage it is issued for
        assert not [n for n in unstaged if at[h2d] < at[n] < start], h2d.name


def test_random_state_off_the_graphs_device_is_in_no_unit():
    """SDPA's random seed and offset on CUDA are traced on the ``meta`` device and made on the
    host, where its backward reads them: in a unit, they were copied to the device and read
    through a device pointer (a segfault on an H200).  Like Inductor's seeds, they are in no
    unit, and so no copy and no checkpoint moves them."""
    from torch import fx

    from offload.executor.compiled_copies import value_units

    graph = fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(torch.ops.aten.relu.default, (x,))
    seed = graph.call_function(torch.ops.aten.clone.default, (x,))
    out.meta["val"], seed.meta["val"] = torch.empty(4), torch.empty((), dtype=torch.int64, device="meta")
    assert value_units({out: 1, seed: 1}, {}, set()) == {out.name: 1}


def test_a_saved_view_of_the_graphs_input_is_in_no_unit():
    """GPT-2 saves ``input_ids.view(-1, seq)`` for its embedding's backward: a view of the
    batch, which the caller holds, so moving it frees nothing (aot_eager: offloading the
    embeddings beside recomputed blocks held its 1 KiB at every forward).  Like the inputs
    themselves it is in no unit and no checkpoint; what the graph makes of them is."""
    from torch import fx

    from offload.executor.compiled_copies import movable

    graph = fx.Graph()
    batch = graph.placeholder("batch")
    view = graph.call_function(torch.ops.aten.view.default, (batch, [16]))
    made = graph.call_function(torch.ops.aten.relu.default, (batch,))
    loss = graph.call_function(torch.ops.aten.sum.default, (made,))
    batch.meta["val"] = torch.empty(4, 4)
    view.meta["val"], made.meta["val"], loss.meta["val"] = batch.meta["val"].view(16), torch.empty(4, 4), torch.empty(())
    graph.output((loss, view, made))
    forward = fx.GraphModule(torch.nn.Module(), graph)
    moving, stay, _ = movable(forward, 1, {view.name: 1, made.name: 1}, {1}, {view.name: 1, made.name: 1, loss.name: 1})
    assert [[v.name for v in s.values] for s in moving] == [[made.name]] and stay == {1: []}


def test_a_value_the_compiler_laid_out_otherwise_is_copied_in_the_graphs_layout():
    """The forward realizes each moved value at the graph's strides, so a compiler that keeps
    that lays none out otherwise; should one still (a pass that drops the request), the copy
    puts the values into the graph's layout first, which the backward's views read, and says
    so once."""
    from offload.executor.graph_copies import GraphCopies

    copies = GraphCopies("cpu-eager")
    copies.device, copies.planned_bytes = torch.device("cpu"), 24 * 4
    x = torch.arange(24.0).reshape(6, 4).t()  # the graph says (4, 6) with strides (6, 1)
    with pytest.warns(UserWarning, match="otherwise than the graph"):
        host = torch.ops.offload.d2h([x], [2, 4, 6, 6, 1, 0], 24, copies.number, 0, [])
    torch.ops.offload.release(host, x, copies.number, 0, [])
    assert copies.relaid == 1 and torch.equal(host.view(4, 6), x)


def test_a_copy_of_a_value_off_the_graphs_device_is_refused():
    """The copies' backend is the graph's device's: a value elsewhere reaching ``offload::d2h``
    (a host-side seed, had it been placed) is refused, not copied through the wrong backend
    (the first value copied used to choose the backend: a host one made it the CPU's)."""
    from offload.executor.graph_copies import GraphCopies

    copies = GraphCopies(None)
    copies.device = torch.device("cuda")  # a graph placed on a GPU; the value on the host
    with pytest.raises(RuntimeError, match="should not have been placed"):
        torch.ops.offload.d2h([torch.zeros(4)], [1, 4, 1, 0], 4, copies.number, 0, [])
    assert copies.backend is None
