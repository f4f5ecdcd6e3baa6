"""A chain of the model compiled whole (``offload.profiler.compiled``): its units are what the
compiled graph's copies move, its memory that graph's, so a schedule solved on it keeps its
budget when ``compile_scheduled`` runs it."""
import gc
import json
import pickle
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from experiments.compiled_op_memory import excess
from offload.cli import main
from offload.errors import ChainMismatch, InfeasibleBudget, ModelError, offload_cause
from offload.executor import Offloaded, distributed
from offload.executor.checks import compiled_reference
from offload.executor.compiled import SchedulePartitioner, compile_scheduled
from offload.executor.compiled_copies import UnitStorage
from offload.executor.train import TrainOptions, train
from offload.models import resolve
from offload.core.meters import AllocationMeter, allocated_peak
from offload.executor.marked import MarkedRun, Marks, intervals
from offload.io.text import format_bytes
from offload.profiler import compiled as profiler_compiled, verify
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.cli import _verified_line
from offload.solver.methods import Options, solve
from offload.step.chainfile import chain_from_dict, load_chain, make_chain, save_chain
from offload.step.schedulefile import load_schedule
from offload.step.memory import (floor_bound_memory, floor_offloads, memory_profile, no_offload_peak, op_name,
                                 smallest_feasible_budget)
from offload.step.actions import Recompute, first_checkpoint_release
from offload.step.recompute import run_op
from offload.step.schedule import make_schedule
from tests.conftest import chain_doc
from tests.cudashim import FakeAllocator

CHAINS = Path(__file__).resolve().parent.parent / "experiments" / "chains"
UNET, UNET_SMALL = Path(__file__).resolve().parent / "models" / "unet.py", {"width": 8, "depth": 2, "image": 32}
GPT = {"layers": 2, "width": 64, "heads": 4, "seq": 64, "vocab": 128, "dropout": 0.1}


def whole(backend):
    return profile("gpt", ProfileOptions(batch=4, repeats=1, warmup=1, encodings=False, options=GPT, compile=backend,
                                         whole_graph=True))


@pytest.fixture(scope="module")
def aot():
    return whole("aot_eager")


def test_each_op_is_timed_between_its_marks():
    # F1 | F2 and the loss | the backward's start .. B2 | B1 and the gradients' accumulation
    assert intervals(2) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    spans = intervals(5)
    assert [b for _, b in spans[:-1]] == [a for a, _ in spans[1:]] and spans[0][0] == 0 and spans[-1][1] == 12


def test_on_cuda_the_marks_read_the_allocators_counters_on_the_host(monkeypatch):
    """Each mark reads the bytes allocated now and at most since the mark before (and resets
    that peak): the caching allocator's counters, kept on the host, no synchronization; an op's
    peak is the most over its marks, beyond the step's start."""
    mib = 2 ** 20
    allocator = FakeAllocator(monkeypatch, allocated=mib, peak=mib, reserved=8 * mib)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: SimpleNamespace(record=lambda: None))
    marks = Marks(torch.device("cuda"), 5)  # one stage: F1 between marks 0 and 2, B1 between 2 and 4
    marks(0)
    allocator.allocate(3 * mib), allocator.free(2 * mib)
    marks(1), marks(2)
    allocator.allocate(mib), allocator.free(mib)
    marks(3)
    allocator.free(mib)
    marks(4)
    assert marks.cuda_peaks(intervals(1)) == [3 * mib, 2 * mib]


def test_the_units_are_what_the_compiled_graph_moves(aot):
    chain = aot.chain
    assert chain.recipe.whole_graph and chain.recipe.compile == "aot_eager"
    assert all(s.need_from == k for k, s in enumerate(chain.stages, 1))
    assert all(s.saved_bytes for s in chain.stages[1:])  # every block's unit, found in the graph
    # the schedule's partitioner counts, for the units it offloads, the bytes the chain does
    offloads = floor_offloads(chain)[:2]
    schedule = make_schedule(chain, offloads)
    spec = resolve("gpt", 4, GPT)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "the budget is not a promise"
        compiled = compile_scheduled(spec.module, chain, schedule, backend="aot_eager")
    spec.loss(compiled(*spec.args)).backward()
    counted = {}
    for s in compiled.partitioner.placed.counted:
        counted[s.unit] = counted.get(s.unit, 0) + s.nbytes
    assert counted == {o.stage: chain.stage(o.stage).saved_bytes for o in offloads}


def test_every_value_the_compiled_backward_is_handed_is_read_so_freed_after_its_reader(aot):
    """A kept storage's values other than the one handed on through ``offload::ready`` were
    inputs of the backward graph that nothing read once their readers read the alias, so
    Inductor freed them at the graph's end, each holding its storage (a GPT's fused query, key
    and value: 1.5 MiB a block; with the weight gradients, ``test_graph_grads``, what made its
    smallest budget 63.7% of its peak, now 31.7%): ``offload::ready`` reads them now.  And
    under aot_eager the graphs run as torch's aot_eager runs them, each input let go after its
    last reader (functorch's ``nop`` compiler held every input of the backward to its end:
    ``B1`` held all the saved values)."""
    spec = resolve("gpt", 4, GPT)
    torch._dynamo.reset()
    compiled = compile_scheduled(spec.module, aot.chain, make_schedule(aot.chain, []), backend="aot_eager")
    spec.loss(compiled(*spec.args)).backward()
    backward = compiled.partitioner.graphs[1]
    assert [n.name for n in backward.graph.find_nodes(op="placeholder") if not n.users] == []
    assert aot.chain.stage(1).bwd_peak_bytes < aot.chain.stage(2).saved_bytes / 4


def over_predictions(chain, schedule, backend, model=("gpt", 4, GPT)):
    """Per op of ``schedule`` compiled with marks (``offload train --op-memory``), its measured
    memory less the simulator's."""
    return marked_step(chain, schedule, backend, model)[1]


def marked_step(chain, schedule, backend, model=("gpt", 4, GPT)):
    """The partitioner of a step of ``schedule`` compiled with marks, and per op its measured
    memory less the simulator's."""
    torch.manual_seed(1)
    partitioner = SchedulePartitioner(chain, schedule, copy_backend="cpu-lazy", marks=True)
    run = MarkedRun(resolve(*model), partitioner, torch.device("cpu"), backend)
    run.step()  # compiles, makes the gradients
    measured = run.op_peaks(chain)
    return partitioner, {o.name: measured[o.name] - o.mem_bytes for o in schedule.simulate(chain).ops}


def test_a_chain_of_the_compiled_graph_recomputes_within_its_predictions(aot):
    """Each stage the eager profile can re-run is offered as a run of one stage, its costs read
    from two more compiles with marks, each recomputing every other such stage: its
    checkpoint (what only its run reads in the backward, its dropout masks included) and its
    forward's transient.  Every op of a schedule recomputing all of them, of one recomputing
    the first and offloading the next, of the joint ILP's at a budget between its floor and
    the peak, and of one offloading the first run's checkpoint holds at most its prediction,
    and each moves the bytes the simulator moves."""
    chain = aot.chain
    eager = profile("gpt", ProfileOptions(batch=4, repeats=1, warmup=0, encodings=False, options=GPT)).chain
    blocks = sorted(chain.recomputable)  # (not the embedding, which saves nothing in this graph)
    assert blocks == [k for k in sorted(eager.recomputable) if k < chain.L and chain.stage(k).saved_bytes]
    assert len(blocks) >= 2
    assert all(chain.stage(k).input_bytes > 0 and not chain.stage(k).rerun_output for k in blocks)
    first, second = blocks[:2]
    budget = (smallest_feasible_budget(chain, recompute=True) + no_offload_peak(chain)) // 2
    schedules = {"all": make_schedule(chain, [], recompute=[Recompute(k, k) for k in chain.recomputable]),
                 "one, the next offloaded": make_schedule(chain, [o for o in floor_offloads(chain) if o.stage == second],
                                                          recompute=[Recompute(first, first)]),
                 "joint ILP": solve(chain, budget, "ilp", Options(time_limit_s=20, recompute=True)).schedule}
    run = Recompute(first, first)
    run = replace(run, release=first_checkpoint_release(chain, run), prefetch=run_op(chain, run))
    schedules["one, its checkpoint offloaded"] = make_schedule(chain, [], recompute=[run])
    for name, schedule in schedules.items():
        partitioner, over = marked_step(chain, schedule, "aot_eager")
        assert max(over.values()) <= 0, (name, over)
        # what the copies move is what the chain books: the checkpoint's input and its own dropout
        # masks (a Qwen2 block's moved twice the input the chain booked)
        assert partitioner.runtime.planned_bytes == schedule.simulate(chain).d2h_bytes, name
    assert partitioner.placed.checkpoint_bytes[first] == chain.stage(first).input_own_bytes > 0


def _partitioned(runs: list[Recompute]) -> SimpleNamespace:
    """What a mocked ``_metered`` hands the fit of its partition: no unit, a 4 KiB checkpoint per run."""
    return SimpleNamespace(counted=[], checkpoints={r.first: (4096, 0) for r in runs})


def test_recomputation_is_offered_only_where_every_compile_held_what_the_chain_books(aot, monkeypatch):
    """The costs are fitted to two compiles, what a third recomputing every stage and those
    recomputing pairs held over them booked, then what two recomputing every other one beside
    the others offloaded held over the chain so costed; all are then set against the costed
    chain: an op of any of them over its prediction (a recomputed forward over its kept one),
    or an offloaded unit that moves more than the chain's, and the chain offers no
    recomputation, with a note saying why.  A kept or offloaded stage's op over its
    prediction is booked as its transient, and an op where a run is rebuilt in its
    rebuild's row alone; where what every schedule pays leaves no schedule with
    recomputation a budget below the smallest without, none is offered."""
    blocks = sorted(aot.chain.recomputable)
    assert 2 in blocks
    chain = replace(aot.chain, stages=tuple(replace(s, recomputable=False) for s in aot.chain.stages))  # as profiled
    spike: dict[str, int] = {}
    spiking = [lambda offloads, runs: True]  # in which compiles the spike is

    def metered(c, offloads, runs, *_):  # each op held nothing but the spike (the fits clamp at nothing)
        held = spike if spiking[0](offloads, runs) else {}
        return [held.get(op_name(c, o), 0) for o in range(2 * c.L)], _partitioned(runs)
    monkeypatch.setattr(profiler_compiled, "_metered", metered)
    offered = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager", lambda _: None)
    assert offered.recomputable == set(blocks)
    # a kept stage's op over its prediction in a compile that fits (stage 3 kept beside its
    # recomputed neighbours): booked as its transient, which counts its largest, and said so
    halves = [Recompute(k, k) for k in blocks[0::2]]
    assert 3 not in blocks[0::2] and 3 in blocks
    b3 = 2 * chain.L - 3
    spike["B3"] = int(memory_profile(offered, [], halves)[0][b3]) + 64
    spiking[0] = lambda offloads, runs: not offloads and runs == halves
    booked = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager", lambda _: None)
    assert booked.recomputable == set(blocks), booked.source["notes"]
    assert booked.stage(3).bwd_peak_bytes == chain.stage(3).bwd_peak_bytes + 64
    assert "a stage's op held more than kept; booked: B3 64 B" in booked.source["notes"][-1]
    # where every schedule pays for it, no schedule with recomputation goes below the smallest
    # budget without: not offered (stage 2 kept beside recomputed neighbours, 1 GiB over at B2,
    # where the floor is)
    spike.clear()
    spike["B2"] = 2 ** 30
    spiking[0] = lambda offloads, runs: not offloads and 2 not in {r.first for r in runs}
    booked = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager", lambda _: None)
    refused = profiler_compiled._paying(chain, booked)
    assert booked.recomputable and not refused.recomputable
    assert "recomputation not offered: what its compiles held over the chain, booked for every schedule, would raise " \
           "the smallest budget by " in refused.source["notes"][-1]
    assert f"from {format_bytes(smallest_feasible_budget(chain))} to " in refused.source["notes"][-1]
    # booked from the compile recomputing every stage too, a recomputed forward's as its
    # recomputed transient (a ViT under Inductor: 520 B in a block's forward), at most its kept one's
    spike.clear()
    every = [Recompute(k, k) for k in blocks]
    first = f"F{blocks[0]}"
    spike[first] = int(memory_profile(offered, [], every)[0][blocks[0] - 1]) + 64
    spiking[0] = lambda offloads, runs: not offloads and len(runs) == len(blocks)
    booked = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager", lambda _: None)
    assert booked.recomputable == set(blocks), booked.source["notes"]
    assert booked.rfp[blocks[0]] == offered.rfp[blocks[0]] + 64
    assert f"booked: {first} recomputed 64 B" in booked.source["notes"][-1]
    if len(blocks) >= 3:  # and from the compiles recomputing pairs of them
        spike.clear()
        spike["B2"] = 2 ** 30
        spiking[0] = lambda offloads, runs: not offloads and [r.first for r in runs] == blocks[:2]
        paired = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager",
                                                       lambda _: None)
        # (stage 2 recomputed there: its rebuild's row at B2 books it, which only its run pays)
        assert paired.recomputable == set(blocks) and "booked: B2 rebuilt " in paired.source["notes"][-1]
        assert paired.stage(2).bwd_peak_bytes == chain.stage(2).bwd_peak_bytes
        spike.clear()
        spike[first] = int(memory_profile(offered, [], every)[0][blocks[0] - 1]) + 64
        spiking[0] = lambda offloads, runs: not offloads and len(runs) == len(blocks)
    spike[first] += chain.stage(blocks[0]).fwd_peak_bytes  # more than its kept forward: refused
    refused = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager", lambda _: None)
    assert not refused.recomputable
    assert "recomputation not offered: compiled recomputing every stage (" in refused.source["notes"][-1]
    assert f"{first} held " in refused.source["notes"][-1]
    # an op over its prediction in a compile beside offloads (every other stage recomputed,
    # the others offloaded; BERT under Inductor, batch 4: 112 B at B5, which refused it all
    # before): booked as the fits' are, and where every schedule pays it so, not offered
    spike.clear()
    beside = [o for o in floor_offloads(offered, halves) if o.stage in blocks[1::2]]
    assert 3 in {o.stage for o in beside}
    spike["B3"] = int(memory_profile(offered, beside, halves)[0][b3]) + 64
    spiking[0] = lambda offloads, runs: offloads == beside and runs == halves
    booked = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager", lambda _: None)
    assert booked.recomputable == set(blocks), booked.source["notes"]
    assert booked.stage(3).bwd_peak_bytes == chain.stage(3).bwd_peak_bytes + 64
    assert booked.source["notes"][-1] == ("recomputing every other stage beside the others offloaded, an op held more "
                                          "than the compiles without offloads; booked: B3 64 B")
    spike.clear()
    spike["B3"] = 2 ** 40
    booked = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager", lambda _: None)
    assert not profiler_compiled._paying(chain, booked).recomputable
    spike.clear()

    def unmovable(c, offloads, runs, *_):  # with a neighbour recomputed, an offloaded unit is not the chain's
        if offloads:
            raise ChainMismatch("the compiled graph moves nothing of U1")
        return metered(c, offloads, runs)
    monkeypatch.setattr(profiler_compiled, "_metered", unmovable)
    refused = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager", lambda _: None)
    assert not refused.recomputable
    assert "beside the rest offloaded: the compiled graph moves nothing of U1" in refused.source["notes"][-1]
    assert refused.source["notes"][-1].startswith("recomputation not offered: compiled recomputing every other stage (")


def test_recomputation_is_offered_only_where_it_lowers_the_smallest_budget():
    """What the compiles that recompute held over the chain, booked where every schedule pays
    it, raises the smallest budget of the schedules that only offload: recomputation is
    offered where a schedule recomputing can still go below the chain's smallest without it
    (a note says what the others pay), and withheld where none can (a Llama under Inductor:
    38.35 MiB offered against 26.23 MiB without)."""
    chain = load_chain(CHAINS / "llama-b4-cpu.json")
    plain = replace(chain, stages=tuple(replace(s, recomputable=False) for s in chain.stages))
    floor = smallest_feasible_budget(plain)
    assert smallest_feasible_budget(chain, recompute=True) < floor - 2 ** 20  # (an eager chain: recomputing pays)
    op = int(floor_bound_memory(plain, False).argmax())
    j, key = (op + 1, "fwd_peak_bytes") if op < chain.L else (2 * chain.L - op, "bwd_peak_bytes")

    def paying(raised: int, where: list[tuple[int, str]]):
        stages = list(chain.stages)
        for k, field in where:
            stages[k - 1] = replace(stages[k - 1], **{field: getattr(stages[k - 1], field) + raised})
        return profiler_compiled._paying(plain, replace(chain, stages=tuple(stages)))
    offered = paying(1024, [(j, key)])
    assert offered.recomputable == chain.recomputable and smallest_feasible_budget(offered) == floor + 1024
    assert f"raised the smallest budget of a schedule that only offloads by 1.00 KiB, from {format_bytes(floor)}" \
           in offered.source["notes"][-1]
    withheld = paying(floor, [(k, "bwd_peak_bytes") for k in range(1, chain.L + 1)])  # every backward op
    assert not withheld.recomputable and withheld.stages == plain.stages
    assert "would raise the smallest budget by " in withheld.source["notes"][-1]


def test_the_pairs_recompute_each_stage_beside_a_kept_and_a_recomputed_neighbour():
    """The three compiles of pairs: every stage recomputed with its left neighbour kept and its
    right one recomputed, and the other way round, wherever it has such neighbours (the halves
    keep both, the compile of every stage recomputes both)."""
    for n in range(3, 12):
        stages = list(range(2, n + 2))
        seen = set()
        for _, part in profiler_compiled._pairs(stages):
            recomputed = set(part)
            seen |= {(k, k - 1 in recomputed, k + 1 in recomputed) for k in part}
        assert all((k, False, True) in seen for k in stages[:-1]) and all((k, True, False) in seen for k in stages[1:])
        assert all(part for _, part in profiler_compiled._pairs(stages))
    assert profiler_compiled._pairs([2, 3]) == []


def test_a_stage_not_offered_is_fitted_and_checked_without(aot, monkeypatch):
    """A stage whose recomputed forward held more than its kept one is not offered; the others'
    costs are then fitted again from compiles that keep it, and checked against such compiles
    only: a compile that recomputed it measured a step the chain does not predict (BERT under
    Inductor: every op after its recomputed embedding norm 7.5 KiB over)."""
    blocks = sorted(aot.chain.recomputable)
    assert len(blocks) >= 3
    chain = replace(aot.chain, stages=tuple(replace(s, recomputable=False) for s in aot.chain.stages))
    greedy = blocks[0]
    compiled: list[list[int]] = []

    def metered(c, offloads, runs, *_):  # recomputing ``greedy``, its forward holds a GiB
        compiled.append([r.first for r in runs])
        L = c.L
        return ([2 ** 30 if any(r.first == greedy for r in runs) and o == greedy - 1 else 0 for o in range(2 * L)],
                _partitioned(runs))
    monkeypatch.setattr(profiler_compiled, "_metered", metered)
    offered = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager", lambda _: None)
    assert offered.recomputable == set(blocks) - {greedy}
    first_fit = 2  # the two halves' compiles, the greedy stage in one
    assert any(greedy in runs for runs in compiled[:first_fit])
    assert all(greedy not in runs for runs in compiled[first_fit:]) and len(compiled) > first_fit + 2


def test_a_kept_unit_counts_its_largest_over_its_neighbours_choices(aot, monkeypatch):
    """With a neighbour recomputed the partition may save more of a kept stage (a ViT block: a
    layer norm's output where it saved its statistics, 24 KiB more) or read a unit from a
    re-run's stage (a GPT's positions, from which each re-run makes the causal mask again):
    the chain counts each unit's largest over the fitting compiles, needed from the latest
    stage that read it, and a compile may move less of an offloaded unit than such a chain
    counts, never more (on a chain offering no recomputation, exactly what it counts)."""
    blocks = sorted(aot.chain.recomputable)
    chain = replace(aot.chain, stages=tuple(replace(s, recomputable=False) for s in aot.chain.stages))
    kept = blocks[1]  # kept in the compile that recomputes every other block, the first among them
    grown = UnitStorage(unit=kept, name="norm", nbytes=chain.stage(kept).saved_bytes + 1024, held_until=kept,
                        need_from=chain.L)

    def metered(c, offloads, runs, *_):
        partitioned = _partitioned(runs)
        partitioned.counted = [grown] if blocks[0] in {r.first for r in runs} else []
        return [0] * (2 * c.L), partitioned
    monkeypatch.setattr(profiler_compiled, "_metered", metered)
    fitted = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager",
                                                   lambda _: None)
    assert fitted.stage(kept).saved_bytes == grown.nbytes and fitted.stage(kept).need_from == chain.L
    assert all(fitted.stage(k).saved_bytes == chain.stage(k).saved_bytes for k in range(1, chain.L + 1) if k != kept)

    def moving(nbytes, runs, chain=fitted):
        offload = [o for o in floor_offloads(chain) if o.stage == kept]
        partitioner = SchedulePartitioner(chain, make_schedule(chain, offload, recompute=runs))
        partitioner.placed = SimpleNamespace(counted=[replace(grown, nbytes=nbytes)])
        partitioner._check_units()
    moving(grown.nbytes - 64, [Recompute(blocks[0], blocks[0])])
    moving(grown.nbytes - 64, [])  # (T5 under Inductor: its first unit 2 KiB smaller with no neighbour recomputed)
    with pytest.raises(ChainMismatch, match="where the chain, profiled from it, counts"):
        moving(grown.nbytes + 64, [Recompute(blocks[0], blocks[0])])
    without = replace(fitted, stages=tuple(replace(s, recomputable=False) for s in fitted.stages))
    with pytest.raises(ChainMismatch, match="where the chain, profiled from it, counts"):  # then exactly its unit
        moving(grown.nbytes - 64, [], without)


def test_a_rebuild_is_fitted_without_what_a_neighbours_forward_held_over_its_checkpoint():
    """A run's checkpoint books what ``F(k+1)`` held over its storages until its rebuild, but
    that may be gone by the next op (a ViT's embeddings re-run under Inductor: 64 KiB at the
    first block's forward).  A later run's rebuild fitted from the compile that recomputes
    both must not count on it: fitted beside it, a ViT block's rebuild came out 64 KiB short,
    and recomputed with the embeddings kept and the unit before offloaded, its ``B4`` held
    that much over its prediction.  Here run 2 books 30 B more than it holds: run 4's rebuild
    is fitted to what it holds, so that with run 2 kept every op is predicted as held, and
    with both recomputed none under."""
    fields = dict(recomputable=True, rerun_output=False, carry_bytes=0, bwd_start_bytes=0, input_own_bytes=20)
    chain = chain_from_dict(chain_doc())
    true = {2: dict(fields, input_bytes=20, rebuilt_bytes=100, rerun_peak_bytes=0),
            4: dict(fields, input_bytes=20, rebuilt_bytes=60, rerun_peak_bytes=0)}
    booked = {2: dict(fields, input_bytes=50), 4: dict(fields, input_bytes=20)}
    both, alone = [Recompute(2, 2), Recompute(4, 4)], [Recompute(4, 4)]

    def held(fitted: dict, runs: list) -> list[int]:
        return [int(m) for m in memory_profile(profiler_compiled._with_fields(chain, fitted), [], runs)[0]]
    rebuilds = profiler_compiled._rebuilds(profiler_compiled._with_fields(chain, booked), both, held(true, both),
                                           {2: 30})
    fitted = {k: {**booked[k], **rebuilds[k]} for k in booked}
    assert rebuilds[4]["rebuilt_bytes"] == 60
    assert held(fitted, alone) == held(true, alone)
    assert all(p >= m for p, m in zip(held(fitted, both), held(true, both)))


def test_a_kept_unit_the_partition_saves_nothing_of_counts_nothing_in_that_fit(aot, monkeypatch):
    """Beside a recomputed neighbour a kept stage may save nothing at all (a ViT's embeddings
    under Inductor: their sum is the first block's checkpoint, which that run's input counts).
    The fit reads that compile with the unit empty: counted at its size there (the chain's),
    the neighbour's recomputed forward was fitted that much too small (a ViT block's, 24 KiB),
    and offloading the unit beside it, which frees nothing there, held that much over."""
    blocks = sorted(aot.chain.recomputable)
    chain = replace(aot.chain, stages=tuple(replace(s, recomputable=False) for s in aot.chain.stages))
    second = blocks[1]
    assert sum(chain.stage(k).saved_bytes for k in range(1, second)) > 0  # the units live at its forward
    target = chain.stage(second).fwd_peak_bytes // 2

    def metered(c, offloads, runs, *_):  # recomputing ``second`` alone, the others save nothing
        measured = [0] * (2 * c.L)
        if [r.first for r in runs] == [second] and not offloads:
            empty = {k: dict(saved_bytes=0) for k in range(1, c.L + 1) if k != second}
            run = dict(input_bytes=4096, input_own_bytes=4096, rerun_held_bytes=0, recomputed_fwd_peak_bytes=target)
            measured[second - 1] = int(memory_profile(profiler_compiled._with_fields(c, {**empty, second: run}), [],
                                                      runs)[0][second - 1])
        return measured, _partitioned(runs)
    monkeypatch.setattr(profiler_compiled, "_metered", metered)
    fitted = profiler_compiled._with_recomputation(chain, blocks, None, torch.device("cpu"), "aot_eager",
                                                   lambda _: None)
    assert second in fitted.recomputable, fitted.source["notes"]
    assert fitted.rfp[second] == target


def test_an_offloaded_unit_the_graph_saves_nothing_of_is_not_refused(aot):
    """Beside a recomputed neighbour, all a stage saved may be that run's checkpoint (a ViT's
    embeddings under Inductor: it saves their sum for the first block's re-run, where a plain
    compile saves the concatenation their own backward makes the sum from).  Offloading that
    unit moves nothing and leaves nothing on the device (the run holds the checkpoint, and the
    chain counts it); only a unit of which something stays is refused."""
    first, second = sorted(aot.chain.recomputable)[:2]
    offload = [o for o in floor_offloads(aot.chain) if o.stage == first]
    partitioner = SchedulePartitioner(aot.chain, make_schedule(aot.chain, offload, recompute=[Recompute(second, second)]))
    partitioner.saved = [(second, 4096, False)]  # the run's checkpoint, in no unit
    partitioner._check_moved()
    assert partitioner.moved == {first: (0, 0)}
    partitioner.saved.append((first, 4096, False))
    with pytest.raises(ChainMismatch, match=f"moves nothing of U{first} "):
        partitioner._check_moved()


@pytest.fixture(scope="module")
def gated():
    """The chain of the shared-gate model compiled whole by aot_eager (its three blocks offered
    for recomputation: nine compiles, 5 s).  Offering it raises this chain's smallest budget
    by the gate, 2 KiB, which a block's unit saves beside a recomputed neighbour and every
    schedule then counts, and lowers no budget, so the profile withholds it (``_paying``,
    tested apart); the fit itself is what these tests check."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiler_compiled, "_paying", lambda chain, costed: costed)
        return profile(SHARED_GATE, ProfileOptions(batch=8, repeats=1, warmup=1, encodings=False,
                                                   compile="aot_eager", whole_graph=True)).chain


def test_a_value_only_recomputed_stages_read_is_booked_with_each_checkpoint(gated):
    """Every block reads the gate the first block makes.  With every block recomputed no kept
    backward reads it, so no unit holds it, and the graph saves it for the re-runs: every op
    from F3 on held 2 KiB that the chain booked nowhere, and it offered no recomputation.  A
    run now books with its checkpoint what it reads that only stages the chain may recompute
    read besides (twice where a kept one reads it too, in its unit)."""
    gate = 8 * 64 * 4
    assert gated.recomputable == {2, 3, 4}, gated.source["notes"]
    assert all(gated.stage(k).input_bytes - gated.stage(k).input_own_bytes >= gate for k in gated.recomputable)
    every = make_schedule(gated, [], recompute=[Recompute(k, k) for k in sorted(gated.recomputable)])
    assert max(over_predictions(gated, every, "aot_eager", (SHARED_GATE, 8, {})).values()) <= 0


def test_a_kept_checkpoint_is_handed_to_the_backward_where_its_first_run_begins(gated):
    """What the runs read of the forward's saved values (their checkpoints, the gate) reaches
    the re-run ops through ``offload::ready`` placed where the first run that reads it begins,
    after the stage before: Inductor fused a BERT layer's re-run, which read its checkpoint
    directly, into the backward two stages before its own (with their softmax), which then
    held it (451 KiB over ``B4``'s prediction)."""
    runs = [Recompute(k, k) for k in sorted(gated.recomputable)]
    partitioner, _ = marked_step(gated, make_schedule(gated, [], recompute=runs), "aot_eager", (SHARED_GATE, 8, {}))
    backward = partitioner.graphs[1].graph
    order = {n: i for i, n in enumerate(backward.nodes)}
    saved = [n for n in backward.find_nodes(op="placeholder") if not n.name.startswith(("primals", "tangents"))]
    assert saved and all(u.target is torch.ops.offload.ready.default for n in saved for u in n.users)
    marks = {n.name: n for n in backward.nodes if n.target is torch.ops.offload.mark.default}
    for r in runs:
        rerun = [n for n in backward.nodes if n.op == "call_function" and partitioner.stages.get(n.name) == r.first]
        read = [a for n in rerun for a in n.all_input_nodes if a.target is torch.ops.aten.as_strided.default]
        assert rerun and read and all(order[a] > order[marks[f"mark_B{r.first + 1}"]] for a in read), r


@pytest.mark.slow  # make test-all (Inductor compiles of a GPT-NeoX, 1 min)
def test_a_gpt_neox_compiled_whole_hands_its_fused_attention_values_on_at_their_offsets():
    """GPT-NeoX splits one fused query/key/value projection into views at offsets of their own.
    A kept storage was handed to the backward as an alias of its first value, whose views
    Inductor then offset twice: the first compile of its profile stopped (setStorage out of
    bounds).  Now the whole storage from element 0 is handed on: it profiles, and trains with
    its floor's units offloaded, every op within its prediction, the bytes predicted moved
    (a copy moves the extent of its storage that the values span, 128 B less than the whole
    storage its release frees: the chain times the copies by their ``moved_bytes``), and
    the gradients those of the compile without the schedule (within the CPU Inductor's
    noise)."""
    model = f"{Path(__file__).resolve().parent / 'models' / 'decoders.py'}:build"
    options = {"arch": "neox", "layers": 2, "width": 64, "seq": 32, "vocab": 128, "dropout": 0.0}  # (SDPA saves the views)
    chain = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options=options,
                                          compile="inductor", whole_graph=True, recompute=False)).chain
    schedule = make_schedule(chain, floor_offloads(chain))
    torch._dynamo.reset()
    report, error = train(None, chain, schedule, TrainOptions(steps=1, backend="cpu-lazy", check_grads=True,
                                                              op_memory=True))
    m, p = report.measured, report.predicted
    assert any(s.moved_bytes is not None and s.moved_bytes < s.saved_bytes for s in chain.stages)
    assert error is None and 0 < m.d2h_bytes_per_step == p.d2h_bytes_per_step
    assert all(m.op_peak_bytes[op] <= p.op_bytes[op] for op in p.op_bytes)
    assert report.grads_match or report.grads_within_noise


@pytest.mark.slow  # make test-all (nine compiles of a BERT)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_post_norm_transformers_bert_compiled_whole_offers_recomputation(backend):
    """A BERT layer's stages end with a layer norm whose output the next stage reads.  With a
    stage recomputed, the partitioner made that output again in the next stage's backward
    from the run's dropout output and input, so the next stage's unit lost it (457 KiB moved
    where the chain counted 489 KiB) and the chain offered no recomputation; a value a later
    stage reads of a multi-output op is now saved with its op, a kept value a run reads is
    saved as it is, and a value read through a view is in the unit of the view's readers.
    Under Inductor a re-run whose checkpoint was there from the start was fused into a kernel
    two stages before its own (451 KiB over the kept stage between); each run's checkpoint
    is now handed to it where it begins.  The five compiles of the check hold what the chain
    books and move at most the chain's units.  (What a kept stage's op held beside a
    recomputed neighbour, booked for every schedule, then raises its smallest budget, 192 B
    under aot_eager and 468 KiB under Inductor, lowering none: the profile withholds it,
    ``_paying``, and says so.)"""
    options = {"layers": 3, "width": 64, "heads": 4, "seq": 64, "vocab": 128}
    paying, costed = profiler_compiled._paying, []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiler_compiled, "_paying", lambda plain, offered: costed.append(offered) or paying(plain, offered))
        chain = profile("bert", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options=options,
                                               compile=backend, whole_graph=True)).chain
    assert len(costed[0].recomputable) >= 6, costed[0].source["notes"]
    assert not any(n.startswith("recomputation not offered") for n in costed[0].source["notes"])
    assert chain.recomputable == costed[0].recomputable or "would raise the smallest budget by " in \
        chain.source["notes"][-1]


def test_solve_verify_solves_again_for_less_where_the_compiled_schedule_held_more_than_the_budget(tmp_path, capsys):
    """A chain that books less at its peak op than the compiled step holds there (as a sampled
    fit may, for a schedule no sampled compile ran): ``solve --verify`` meters the first
    schedule compiled, finds it over the budget at that op, solves again for that much under
    its predicted peak, and writes a schedule that held the budget compiled, the budget asked
    for kept.  (A U-Net under aot_eager, no recomputation offered: one compile to profile.)"""
    chain = profile(f"{UNET}:build", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options=UNET_SMALL,
                                                    compile="aot_eager", whole_graph=True, recompute=False)).chain
    predicted = [int(b) for b in memory_profile(chain, [], [])[0]]
    op = predicted.index(max(predicted))
    short = (max(predicted) - sorted(predicted)[-2]) // 2  # booked short, still the peak op
    assert op >= chain.L and short > 0 and smallest_feasible_budget(chain) <= max(predicted) - 2 * short
    j = 2 * chain.L - op  # (its stage's backward: its transient booked short)
    stages = list(chain.stages)
    stages[j - 1] = replace(stages[j - 1], bwd_peak_bytes=stages[j - 1].bwd_peak_bytes - short)
    # a slow link: at its own peak the wrong chain's optimum offloads nothing (at this CPU's
    # measured link an offload may cost nothing, and a tie of the profile's times chose one,
    # lowering the peak op: one round, in about one fresh clone in three)
    slow = replace(chain.platform, d2h_bytes_per_s=1e5, h2d_bytes_per_s=1e5)
    wrong = replace(chain, stages=tuple(stages), platform=slow)
    budget = no_offload_peak(wrong)  # the wrong chain's schedule offloads nothing; compiled it holds `short` more
    lines = []
    result = verify.solve_verified(wrong, budget, "ilp", Options(time_limit_s=20), lines.append)
    verified = result.schedule.solver["verified"]
    assert verified["rounds"] == 2 and f"{op_name(chain, op)} {format_bytes(short)} over" in lines[1], lines
    assert verified["solved_for_bytes"] == budget - short and result.schedule.offloads
    assert verified["measured_peak_bytes"] <= budget and result.schedule.budget.nbytes == budget
    assert result.simulation.peak_bytes <= budget - short
    save_chain(chain, tmp_path / "chain.json")  # the chain as profiled, from the command line: held at once
    out = tmp_path / "schedule.json"
    assert main(["solve", str(tmp_path / "chain.json"), "--budget", "97%", "--verify", "-o", str(out)]) == 0
    printed = capsys.readouterr()
    assert "verified     compiled and metered: peak" in printed.out and "verify: compiled with marks" in printed.err
    written = load_schedule(out, chain)
    assert written.solver["verified"]["rounds"] == 1
    assert written.solver["verified"]["moved_bytes"] == written.simulate(chain).d2h_bytes > 0
    assert f"its copies move {format_bytes(written.simulate(chain).d2h_bytes)} each way, as booked" in printed.out
    wrongly = {**written.solver["verified"], "booked_moved_bytes": 1024}  # (what a chain that books otherwise says)
    assert "moved more than the schedule books (each way" in _verified_line(wrongly, budget)
    assert "a defect of the chain" in _verified_line(wrongly, budget)
    fewer = {**written.solver["verified"], "booked_moved_bytes": written.solver["verified"]["moved_bytes"] + 128}
    assert "copy time is that much too long (an upper bound)" in _verified_line(fewer, budget)  # an extent moved
    assert main(["solve", str(tmp_path / "chain.json"), "--budget", "97%"]) == 0  # without --verify: said
    assert "verified     not: each op's memory comes from the profile's compiles" in capsys.readouterr().out


def test_solve_verify_gives_up_after_its_rounds_and_below_the_floor(monkeypatch):
    """The loop itself, each compile's metering mocked: a solve for less each round, each
    under the last schedule's predicted peak by what it held over the budget; refused with
    the reason once no budget is left or the rounds are spent."""
    chain = replace(load_chain(CHAINS / "gpt-b2-cpu.json"), source={"device": "cpu"})
    chain = replace(chain, recipe=replace(chain.recipe, compile="aot_eager", whole_graph=True))
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain)
    solved_for = []

    def meter(chain, schedule, device, over):  # each schedule held `over` more than the no-offload peak
        predicted = tuple(int(o.mem_bytes) for o in schedule.simulate(chain).ops)
        solved_for.append(schedule.budget.nbytes)
        return verify.Metered((peak + over, *predicted[1:]), predicted)
    monkeypatch.setattr(verify, "meter", lambda c, s, d: meter(c, s, d, (peak - floor) // 8))
    with pytest.raises(InfeasibleBudget, match="in 4 solves"):
        verify.solve_verified(chain, peak, "ilp", Options(time_limit_s=10))
    assert len(solved_for) == 4 and all(b < a for a, b in zip(solved_for, solved_for[1:]))
    solved_for.clear()
    monkeypatch.setattr(verify, "meter", lambda c, s, d: meter(c, s, d, peak - floor + 1))
    with pytest.raises(InfeasibleBudget, match="solved again for .*below the smallest feasible budget"):
        verify.solve_verified(chain, peak, "ilp", Options(time_limit_s=10))
    assert len(solved_for) == 1


def test_solve_verify_is_refused_where_it_cannot_meter_the_compiled_graph(tmp_path, monkeypatch, capsys):
    """Only a chain of the compiled graph is verified, and only on the kind of device it was
    profiled on: one clear message, exit 2, no schedule written."""
    out = tmp_path / "schedule.json"
    assert main(["solve", str(CHAINS / "gpt-b2-cpu.json"), "--budget", "80%", "--verify", "-o", str(out)]) == 2
    assert "not a chain of the model compiled whole" in capsys.readouterr().err and not out.exists()
    chain = load_chain(CHAINS / "gpt-b2-cpu.json")
    on_gpu = replace(chain, source={"device": "NVIDIA H100 80GB HBM3"},
                     recipe=replace(chain.recipe, compile="inductor", whole_graph=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match="profiled on NVIDIA H100.*sees no CUDA GPU"):
        verify.verifying_device(on_gpu)


def test_a_chain_of_one_graph_is_refused_where_it_does_not_hold(aot):
    chain = aot.chain
    with pytest.raises(ChainMismatch, match="compiled as one graph .*stage boundaries would break"):
        Offloaded(resolve("gpt", 4, GPT).module, chain, make_schedule(chain, []))
    staged = make_chain(chain.name, list(chain.stages), chain.platform, chain.base_bytes, chain.source,
                        replace(chain.recipe, whole_graph=False))
    with pytest.raises(ChainMismatch, match="with a graph break at every stage boundary"):
        compile_scheduled(resolve("gpt", 4, GPT).module, staged, make_schedule(staged, []), backend="aot_eager")
    with pytest.raises(ChainMismatch, match="compiled by aot_eager, not inductor"):
        compile_scheduled(resolve("gpt", 4, GPT).module, chain, make_schedule(chain, []), backend="inductor")
    # a chain whose unit is not the graph's (another model, batch, torch): refused as the graph is made
    stages = list(chain.stages)
    stages[1] = replace(stages[1], saved_bytes=stages[1].saved_bytes - 64)
    other = make_chain(chain.name, stages, chain.platform, chain.base_bytes, chain.source, chain.recipe)
    offload = make_schedule(other, floor_offloads(other)[:2])
    torch._dynamo.reset()
    spec = resolve("gpt", 4, GPT)
    compiled = compile_scheduled(spec.module, other, offload, backend="aot_eager")
    with pytest.raises(Exception) as error:
        compiled(*spec.args)
    assert "where the chain, profiled from it, counts" in str(offload_cause(error.value))
    with pytest.raises(ModelError, match="needs --compile inductor or aot_eager"):
        profile("gpt", ProfileOptions(batch=4, options=GPT, whole_graph=True))


def test_the_gradient_check_recomputes_as_ours_only_under_inductor(aot):
    """The reference ``--check-grads`` compiles moves nothing; under Inductor it recomputes
    what ours does (Inductor fuses recomputed kernels otherwise: rounding, which the Llama
    test in tests/test_compiled.py shows gone against this reference), under aot_eager
    nothing, so that recomputation is checked too."""
    chain = aot.chain
    runs = [Recompute(i, i) for i in sorted(chain.recomputable)[:1]]
    ours = make_schedule(chain, floor_offloads(chain)[:1], recompute=runs)
    inductor, said = compiled_reference(chain, ours, "inductor")
    assert inductor.recompute == tuple(runs) and not inductor.offloads and "recomputing" in said
    for schedule, backend in [(ours, "aot_eager"), (make_schedule(chain, floor_offloads(chain)), "inductor")]:
        plain, said = compiled_reference(chain, schedule, backend)
        assert not plain.recompute and not plain.offloads and said == "the same compile without the schedule"


@pytest.mark.slow  # make test-all (time: a fresh clone's make test came to 2:57)
def test_offload_train_runs_a_chain_of_the_compiled_graph_under_compile_scheduled(aot, monkeypatch):
    """``offload train`` on such a chain: the model compiled as one graph with the schedule in
    it, its allocations metered on the CPU (``AllocationMeter``), the bytes moved, the
    gradient check against the same compile without the schedule, ``--op-memory`` (the
    schedule compiled again with marks: each op within its prediction) and ``--compare`` (each baseline compiled alike, its
    compiling step not measured: without offloading, the peak of the chain without a
    schedule); what that run cannot give is refused."""
    chain = aot.chain
    schedule = make_schedule(chain, floor_offloads(chain)[:2])
    sim = schedule.simulate(chain)
    torch._dynamo.reset()
    report, error = train(None, chain, schedule, TrainOptions(steps=1, backend="cpu-lazy", check_grads=True,
                                                              op_memory=True, compare=True))
    m = report.measured
    assert error is None and report.steps_done == 1
    assert 0 < m.activation_peak_bytes <= sim.peak_bytes
    assert m.d2h_bytes_per_step == m.h2d_bytes_per_step > 0
    assert report.grads_match or report.grads_within_noise
    assert report.grad_reference == compiled_reference(chain, schedule, "aot_eager")[1]
    predicted = report.predicted.op_bytes
    assert list(m.op_peak_bytes) == list(predicted) and len(predicted) == 2 * chain.L
    assert all(0 < m.op_peak_bytes[op] <= predicted[op] for op in predicted), \
        {op: m.op_peak_bytes[op] - predicted[op] for op in predicted}
    compare = report.compare
    assert set(compare) == {"no_offload", "save_on_cpu", "selective_checkpoint"}
    assert all(b.error is None and b.step_s and b.activation_peak_bytes for b in compare.values())
    assert compare["no_offload"].activation_peak_bytes <= no_offload_peak(chain)
    assert compare["no_offload"].activation_peak_bytes > m.activation_peak_bytes
    assert report.compare_our_step_times_s == []  # one way after the other
    assert report.predicted.no_offload_profiled  # the pace: against the graph's own step, as profiled
    assert report.pace == compare["no_offload"].step_s / chain.source["plain_step_s"]["median"]
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(ChainMismatch, match="does not give --nproc yet"):  # before anything starts
        train(None, chain, schedule, TrainOptions(steps=1))


@pytest.mark.slow  # one more compiled run: make test-all
def test_offload_train_traces_a_step_of_the_compiled_graph(aot, tmp_path):
    """``--trace`` on such a chain: one more step of the compiled run under ``torch.profiler``,
    the graph's own copy ops in the trace."""
    chain = aot.chain
    schedule = make_schedule(chain, floor_offloads(chain)[:2])
    torch._dynamo.reset()
    report, error = train(None, chain, schedule, TrainOptions(steps=1, backend="cpu-lazy", trace=str(tmp_path / "t.json")))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert error is None and report.trace["path"] == str(tmp_path / "t.json")
    assert any(e.get("name") == "offload::d2h" for e in events)


def test_a_model_under_its_own_checkpointing_is_profiled_and_trained_compiled_whole():
    """transformers' own activation checkpointing, compiled whole: each checkpoint saves the
    random state to draw its region's numbers again, a storage whose size the compiler leaves
    symbolic under torch 2.13 (its profile failed writing that size into the chain).  There it
    stays on the device (no copy could size it), said so, and the chain counts its size as
    traced; torch 2.14's compiler gives it a size, and it moves with its unit.  Either way a
    schedule offloading the floor trains as the compiled model without it."""
    model = str(Path(__file__).resolve().parent / "models" / "decoders.py") + ":build"
    opts = {"checkpointing": 1, "layers": 1, "dropout": 0.0, "width": 32, "seq": 16, "vocab": 64}
    profiled = profile(model, ProfileOptions(batch=1, repeats=1, warmup=1, encodings=False, options=opts,
                                             compile="aot_eager", whole_graph=True, recompute=False))
    chain = profiled.chain
    assert all(type(s.saved_bytes) is int for s in chain.stages) and chain.stage(2).saved_bytes > 0
    # the compiled backward re-runs the checkpointed layer early: the floor is near the peak, and
    # the warning says why (not "try --stages")
    assert any("the model checkpoints its own layers" in w for w in profiled.warnings), profiled.warnings
    schedule = make_schedule(chain, floor_offloads(chain))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        report, error = train(None, chain, schedule, TrainOptions(steps=1, backend="cpu-lazy", check_grads=True))
    in_part = [str(w.message) for w in said if "only in part" in str(w.message)]
    symbolic = torch.torch_version.TorchVersion(torch.__version__) < "2.14"
    assert len(in_part) == symbolic and all("(a size the compiler left symbolic)" in w for w in in_part), in_part
    assert error is None and report.grads_match
    assert report.measured.d2h_bytes_per_step == schedule.simulate(chain).d2h_bytes > 0


def test_the_partitioner_pickles_as_its_key(aot):
    one = SchedulePartitioner(aot.chain, make_schedule(aot.chain, []))
    assert pickle.loads(pickle.dumps(one)) == one.uuid()


@pytest.mark.slow  # make test-all (time: two Inductor compiles, 10 s)
def test_each_op_of_a_just_in_time_schedule_keeps_its_prediction_under_inductor():
    """Every unit released at once and fetched just in time (the floor schedule) on a GPT's
    Inductor chain: every op's memory (``--op-memory``) at or below its prediction.  Two of
    Inductor's choices broke it (on two layers): a dropout mask that only our D2H read was not
    made where the graph makes it, so Inductor kept the random numbers for a later kernel to
    make the mask again (+64 KiB through F3 and F4); and a node of ``B4`` fused into ``B3``'s
    first kernel, after ``B3``'s prefetches (``U3`` held through ``B4``'s work: +1 MB)."""
    one_layer = {**GPT, "layers": 1}
    chain = profile("gpt", ProfileOptions(batch=4, repeats=1, warmup=1, encodings=False, options=one_layer,
                                          compile="inductor", whole_graph=True, recompute=False)).chain
    schedule = make_schedule(chain, floor_offloads(chain))
    torch.manual_seed(1)
    run = MarkedRun(resolve("gpt", 4, one_layer), SchedulePartitioner(chain, schedule, copy_backend="cpu-lazy", marks=True),
                    torch.device("cpu"), "inductor")
    run.step()  # compiles, makes the gradients
    ops = run.op_peaks(chain)  # what offload train --op-memory reads
    predicted = {o.name: o.mem_bytes for o in schedule.simulate(chain).ops}
    assert all(ops[op] <= predicted[op] for op in predicted), {op: ops[op] - predicted[op] for op in predicted}


SHARED_GATE = str(Path(__file__).parent / "models" / "shared_gate.py") + ":build"


def each_op_over_its_prediction(backend):
    """Per schedule offloading one unit of the shared-gate model, at each prefetch point: how
    much each op's memory (``--op-memory``) is over its prediction."""
    return excess(SHARED_GATE, {}, 8, backend, every_point=True)


def test_a_storage_a_later_stages_backward_reads_is_in_no_unit():
    """The first block's gate is read by every block's backward: it is in no unit, as the
    eager chain's shared saves, and stays on the device, in the memory of the ops it lives
    through, so that its block's unit is needed from its own backward (in the unit, it made
    the unit needed from the last block's backward: a Llama's first layer, 13 MiB, fetched
    three stages early for a storage a later layer's re-run reads).  Every op of every
    single offload, fetched at each of its points, is within its prediction."""
    chain, over = each_op_over_its_prediction("aot_eager")
    assert all(s.need_from == k for k, s in enumerate(chain.stages, 1))
    assert all(v <= 0 for ops in over.values() for v in ops.values()), over


@pytest.mark.slow  # make test-all (Inductor compiles, 10 s)
def test_each_op_of_each_single_offload_keeps_its_prediction_under_inductor():
    """The same under Inductor, which computed the gate's ``clone`` again in every block's
    kernels unless made to keep it (the gate held to the last block: 32 B over), and fused a
    block's product with the block before's backward unless the kept units were handed on as
    fetched ones (``offload::ready``: 2 KiB over where a fetch split that kernel)."""
    _, over = each_op_over_its_prediction("inductor")
    assert all(v <= 0 for ops in over.values() for v in ops.values()), over


@pytest.mark.slow
def test_a_schedule_solved_on_the_compiled_chain_keeps_its_budget_compiled():
    chain = whole("inductor").chain
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain)
    assert floor < peak
    budget = floor + (peak - floor) // 2
    schedule = solve(chain, budget, "ilp", Options(time_limit_s=20)).schedule
    predicted = schedule.simulate(chain).peak_bytes
    assert schedule.offloads and predicted <= budget
    torch.manual_seed(1)
    spec = resolve("gpt", 4, GPT)
    torch._dynamo.reset()
    compiled = compile_scheduled(spec.module, chain, schedule)
    params = list(spec.module.parameters())
    batches = [spec.batch() for _ in range(3)]

    def step():
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        args, kwargs = batches.pop()
        spec.loss(compiled(*args, **kwargs)).backward()
    step(), step()
    measured = allocated_peak(step, torch.device("cpu"))
    assert 0.9 * predicted <= measured <= predicted <= budget
    torch._dynamo.reset()  # and every op within its prediction (offload train --op-memory)
    report, error = train(None, chain, schedule, TrainOptions(steps=1, backend="cpu-lazy", op_memory=True))
    assert error is None
    ops, predicted_ops = report.measured.op_peak_bytes, report.predicted.op_bytes
    assert all(ops[op] <= predicted_ops[op] for op in predicted_ops), {op: ops[op] - predicted_ops[op] for op in predicted_ops}


BREAK = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = torch.relu(block(x))
            if i == 0 and float(x.mean().item()) > 1e9:  # data-dependent: a graph break
                x = x * 2
        return x.sum()


def build(batch_size, **options):
    return Net(), torch.randn(batch_size, 16)
'''


@pytest.mark.slow
def test_a_model_that_breaks_the_graph_is_told_how_to_profile(tmp_path):
    (tmp_path / "breaks.py").write_text(BREAK)
    with pytest.raises(ModelError, match="compiling .* as one graph failed") as error:
        profile(f"{tmp_path / 'breaks.py'}:build", ProfileOptions(batch=4, repeats=1, warmup=1, encodings=False,
                                                                  compile="aot_eager", whole_graph=True))
    assert "find its graph breaks with torch._dynamo.explain" in error.value.hint


@pytest.mark.slow  # make test-all (a ConvNeXt compiled whole, 40 s)
def test_a_metered_compiled_step_comes_after_the_steps_that_compile_it():
    """A transformers ConvNeXt recompiles at its second step (its loss sets the config's
    problem type at the first), and that step allocates 8 B per stochastic-depth block that
    stay from then on: the profile reads a later step, and ``solve --verify`` read the second
    (32 B over at every op, as "F1 held 32 B over its prediction"); every metered compile now
    comes after ``WARM_STEPS``, as ``train --op-memory`` does."""
    from tests.runs import ROOT
    chain = profile(str(ROOT / "tests" / "models" / "convnext.py") + ":build",
                    ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, compile="inductor",
                                   whole_graph=True, recompute=False)).chain
    torch._dynamo.reset()
    step = verify.meter(chain, make_schedule(chain, floor_offloads(chain)), torch.device("cpu"))
    over, op = step.most_over()
    assert over <= 0, f"{op_name(chain, op)} held {over} B over its prediction"


def test_metering_a_compiled_step_prints_nothing_of_torch_profilers_own():
    """torch 2.13's profiler writes "USDT: ... profiler_start" and "profiler_stop" lines to the
    process's stderr from C++ each time it starts and stops: a compiled step metered op by op
    (``offload profile --compile B --whole-graph``, ``train --op-memory``) printed them into the
    command's output.  The meter's profiler does not; a plain one, in the same process, does."""
    code = ("import sys, torch\n"
            "from offload.core.meters import AllocationMeter\n"
            "meter = AllocationMeter(); meter.boundary(); torch.ones(8) + 1; meter.boundary()\n"
            "print('metered', file=sys.stderr, flush=True)\n"
            "with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]): torch.ones(8) + 1\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stderr
    metered, plain = err.split("metered\n")
    if "profiler_start" not in plain:  # torch 2.11's profiler prints nothing of its own either
        assert torch.torch_version.TorchVersion(torch.__version__) < "2.13" and not metered, err
        return
    assert "USDT" not in metered, err


def test_a_metered_step_reads_no_free_of_earlier_garbage_as_its_own(aot, monkeypatch):
    """Garbage made under an earlier profile (a compile's, a step's reference cycles) that the
    collector frees inside a metered step reads, in the profiler's running count, as the
    step's memory falling: ``MarkedRun.peaks`` collects it before the step (an automatic
    collection at the first mark stands in for one that came mid-step)."""
    torch.manual_seed(1)
    run = MarkedRun(resolve("gpt", 4, GPT), SchedulePartitioner(aot.chain, make_schedule(aot.chain, []), marks=True),
                    torch.device("cpu"), "aot_eager")
    run.step()
    clean = run.peaks()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
        garbage = [torch.empty(4 << 20, dtype=torch.uint8)]
        garbage.append(garbage)  # a cycle: only the collector frees it
    del garbage
    mark = Marks.__call__
    monkeypatch.setattr(Marks, "__call__", lambda self, index: (index != 1 or gc.collect(), mark(self, index)))
    assert run.peaks() == clean


def test_the_allocation_meter_counts_from_its_own_start_whatever_the_process_metered_before():
    """``torch.profiler``'s running count of CPU allocations keeps a block made under one
    profile and freed between profiles (a step's outputs, kept past its interval), and counts
    a free under a later one: read as it was, each step of such a loop read 1 MiB more than
    the last, and a process that had metered other models read each op over what it held.
    The meter counts from its own start."""
    readings, blocks = [], []
    for _ in range(3):
        blocks.clear()  # between the steps: the last step's block freed
        meter = AllocationMeter()
        meter.boundary()
        blocks.append(torch.empty(1 << 20, dtype=torch.uint8))  # made in the step, freed after it
        torch.empty(1 << 10, dtype=torch.uint8)  # made and freed in it
        readings.append(meter.boundary())
    assert readings == [(2 ** 20 + 2 ** 10, 2 ** 20)] * 3
    meter = AllocationMeter()
    meter.boundary()
    blocks.clear()  # a free, in this interval, of a block made under an earlier profile
    assert meter.boundary() == (0, -(2 ** 20))


@pytest.mark.slow  # make test-all (time): the eager path is tested in make test
def test_a_saved_conjugate_view_moved_by_the_compiled_graph_comes_back_conjugate():
    """The compiled graph of Autoformer-like blocks saves ``aten._conj`` of a spectrum, a view
    with the conjugate bit: every unit offloaded, its copies read it back with the bit (the
    eager runtime once dropped it: tests/test_executor.py), gradients bit for bit."""
    model = str(Path(__file__).resolve().parent / "models" / "spectral.py") + ":build"
    chain = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, compile="aot_eager",
                                          whole_graph=True)).chain
    report, error = train(None, chain, make_schedule(chain, floor_offloads(chain)), TrainOptions(steps=1, check_grads=True))
    assert error is None and report.grads_match is True and report.measured.d2h_bytes_per_step > 0


IDENTITY_SCALE = '''
import torch
from torch import nn


class Block(nn.Module):
    """timm's MetaFormer block: its residual branch scaled by an ``nn.Identity`` where no layer
    scale is asked for, called on a value the block's own code made."""

    def __init__(self, width):
        super().__init__()
        self.mix, self.mlp, self.res_scale = nn.Linear(width, width), nn.Linear(width, width), nn.Identity()

    def forward(self, x):
        h = x + self.mix(x)
        return self.res_scale(h) + self.mlp(h)


def build(batch_size):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 4)), torch.randn(batch_size, 8)
'''


def test_a_call_that_computes_nothing_is_no_stage_boundary_of_the_compiled_graph(tmp_path):
    """timm's PoolFormer profiled --whole-graph failed: its eager profile cut at each block's
    ``res_scale2``, an ``nn.Identity`` on the value the block's code made, and the compiled
    graph has no node of that call to end a stage at ("runs some of the chain's cut sites but
    not ..."). The capture knows which candidates made no node, the compiled graph's profile
    cuts elsewhere only, and a schedule trains."""
    (tmp_path / "scaled.py").write_text(IDENTITY_SCALE)
    model = f"{tmp_path / 'scaled.py'}:build"
    cap = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).capture
    assert {site.module for site in cap.idle} == {"1.res_scale", "2.res_scale"}
    chain = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, compile="aot_eager",
                                          whole_graph=True, recompute=False)).chain
    assert chain.recipe.cuts and not any("res_scale" in cut for cut in chain.recipe.cuts)
    torch._dynamo.reset()
    report, error = train(None, chain, make_schedule(chain, floor_offloads(chain)),
                          TrainOptions(steps=1, backend="cpu-lazy", check_grads=True))
    assert error is None and report.grads_match
