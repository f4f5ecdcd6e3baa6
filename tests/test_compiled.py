"""The schedule inside ``torch.compile`` (``offload.executor.compiled``): the compiled graph's
forward nodes in the chain's stages, the recomputed stages' ops run again in its backward,
gradients bit for bit those of plain ``torch.compile`` (dropout on)."""
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from offload.errors import ChainMismatch
from offload.executor import Offloaded
from offload.executor.compiled import SchedulePartitioner, compile_scheduled, module_path
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.step.actions import Recompute
from offload.step.chain import MATMULS, StageOption
from offload.step.memory import floor_offloads
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
    assert all(p.tags[n] is None for n, k in p.stages.items() if k not in recomputed)  # the partitioner's choice
    assert all(any(p.tags[n] == CheckpointPolicy.MUST_RECOMPUTE for n, k in p.stages.items() if k == j)
               for j in recomputed)
    (fw_kept, bw_kept), (fw, bw) = kept.partitioner.graphs, p.graphs
    assert matmuls(bw) > matmuls(bw_kept) and saved(fw) < saved(fw_kept)  # the blocks' matmuls again, fewer saved
    before, after = kept.partitioner.saved_bytes(), p.saved_bytes()
    assert set(before) <= set(range(chain.L + 1)) and all(after.get(j, 0) < before[j] for j in recomputed)


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


def test_offloaded_units_go_to_the_host_where_pytorch_places_them(chain):
    """The units the schedule offloads, marked in the joint graph: PyTorch's offloading puts
    their saved tensors' copies in the forward graph and the reloads in the backward one
    (``device_put``: on the CPU a copy to the CPU), gradients bit for bit, and what it moved
    of each unit is said."""
    offloads = floor_offloads(chain)[1::2]
    _, plain = step(lambda m: torch.compile(m, backend="aot_eager"))
    with pytest.warns(UserWarning, match=r"moves U\d+ \(.* stay\).* only in part"):  # the getitems and views it skips
        ours, grads = step(lambda m: compile_scheduled(m, chain, make_schedule(chain, offloads), backend="aot_eager"))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    p = ours.partitioner
    fw, bw = p.graphs
    puts = [n for n in fw.graph.nodes if n.target == torch.ops.prims.device_put.default]
    assert puts and {p.stages[n.args[0].name] for n in puts} == {o.stage for o in offloads}
    assert sum(1 for n in bw.graph.nodes if n.target == torch.ops.prims.device_put.default) == len(puts)
    assert set(p.moved) == {o.stage for o in offloads} and all(moved > 0 for moved, _ in p.moved.values())


def test_what_a_compiled_graph_cannot_run_is_refused(chain):
    encoded = replace(make_schedule(chain, []), encode={2: "lossless"})
    with pytest.raises(ChainMismatch, match="runs no encoder, and this schedule encodes U2"):
        SchedulePartitioner(chain, encoded)
    i = next(i for i in sorted(chain.recomputable) if chain.stage(i).input_own_bytes)
    moved = make_schedule(chain, [], [Recompute(i, i, release=chain.L, prefetch=chain.L)])
    with pytest.raises(ChainMismatch, match=rf"offloads the checkpoints of {i} \(checkpoint"):
        SchedulePartitioner(chain, moved)
    wrapped = resolve("gpt", 2, GPT).module
    Offloaded(wrapped, chain, make_schedule(chain, []))
    with pytest.raises(ChainMismatch, match="inside an Offloaded: its stage boundaries break a compiled graph"):
        compile_scheduled(wrapped, chain, make_schedule(chain, []))
    with pytest.raises(ChainMismatch, match="no submodule 'wte'"):
        compile_scheduled(resolve("mlp", 2, {"layers": 2, "width": 8, "features": 4, "classes": 3}).module, chain,
                          make_schedule(chain, []))


def test_the_compile_cache_key_follows_the_schedule(chain):
    a, b = (make_schedule(chain, [], recompute=[Recompute(i, i)]) for i in sorted(chain.recomputable)[:2])
    moving = make_schedule(chain, floor_offloads(chain)[:1], recompute=a.recompute)
    assert SchedulePartitioner(chain, a).uuid() == SchedulePartitioner(chain, a).uuid()
    assert len({SchedulePartitioner(chain, s).uuid() for s in (a, b, moving)}) == 3


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
