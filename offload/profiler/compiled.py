"""A chain of the model compiled whole: the units its graph saves, its stages' times and memory.

``offload profile --compile inductor --whole-graph`` (``ProfileOptions.whole_graph``).  The
compiled forward saves other tensors than the eager code, fewer and fused, and its kernels
hold other transients; a chain of the eager model predicts neither.  So, with the cuts the eager profile found:

* the model is compiled as ``compile_scheduled`` compiles it (one graph, the same
  partitioner, Inductor's ``compiled.PLANNED_OPTIONS``), with no schedule and with the
  profiler's marks (``offload::mark``) at its stage boundaries (``compiled_copies.place_marks``),
  every unit's storages handed to the backward as if fetched (``compiled_copies.place_ready``);
* a **unit** is what the copies would move of a stage (``compiled_copies.movable``, every
  stage as if offloaded): the saved storages whose first backward reader is the stage's,
  whole (what freeing one frees), those the copies cannot move (the model's output, values
  of several dtypes) left to the ops' memory; where a copy moves less than a storage (the
  extent its values span: a ViT's 1.13 MiB a step where its storages held 1.19), the unit's
  copies are timed by what they move (``moved_bytes``); a storage that a later stage's forward reads
  too is held through it (``held_bytes``/``held_until``: the graph keeps it, and Inductor
  keeps each elementwise value a later stage reads, ``compiled_copies.keep_crossing``); a
  unit is needed from the first backward stage that reads any of its storages (``need_from``),
  its own or the next: a storage a later stage's backward reads first is in no unit
  (``compiled_copies.shared_saves``: it stays, in the ops' memory);
* **times**: between the marks of each op, medians over the timed steps (CUDA events on the
  compute stream, ``perf_counter`` on the CPU); ``FL`` counts the loss, ``B1`` what follows
  the graph, as the eager profile counts it (each weight's gradient is accumulated into
  ``.grad`` inside the graph, where it is made: ``executor.graph_grads``);
* **memory**: the most bytes allocated in each op's interval beyond those allocated as the
  step began (CUDA: the caching allocator's counters, read at each mark on the host, where
  the allocator runs; CPU: ``torch.profiler``'s memory events between the marks), less the
  units the chain holds there, is the op's transient (``fwd_peak_bytes``, ``bwd_peak_bytes``):
  everything the schedule cannot move is in it, the gradients made so far where the step
  frees them between steps (``set_to_none``) included.

The chain then predicts the no-offload step's peak as measured, and a schedule's by moving
only what the copies move.  No encoding is offered (no encoder runs in a graph).

**Recomputation**: each stage the eager profile can re-run is offered as a run of one stage
(``rerun_output: false``), its costs read as the model states them (docs/model.md,
"Recomputation") from two more compiles with marks, one recomputing every other such stage
and one the rest, so that a run's neighbours are kept, as in most schedules:

* its checkpoint, ``input_bytes``: the saved storages that only its run reads in the
  backward (``SchedulePartitioner.checkpoints``): its input and what its own forward made
  (its dropouts' outputs and masks, which a compiled run saves where the eager one draws
  them again), all of which offloading the checkpoint moves (``input_own_bytes``: a Qwen2
  block's checkpoint moved 130 KiB where the chain booked its input's 64 KiB, the rest
  counted on the device, before the twenty-third session); plus what it reads that only stages the chain may
  recompute read besides (a mask every attention reads, Inductor's random seeds: with them
  all recomputed no unit holds it, so each run books it, and a kept reader's unit too); plus
  what ``F(k+1)`` holds over its prediction in that compile, which stays until the run is
  rebuilt (under Inductor 64 KiB a GPT block: held through ``F(k+2)`` and ``B(k+1)`` too;
  no storage a move of the checkpoint takes);
* its forward's transient when autograd keeps none of its unit
  (``recomputed_fwd_peak_bytes``), fitted so that the simulator gives that compile's
  measured ``Fk`` exactly (a stage whose recomputed forward held more than its kept one is
  not offered, and the others are fitted again from compiles that keep it:
  ``_fitted_offered``);
* its rebuild: a compiled backward re-runs each recomputed op right before its reader, inside
  ``Bk``, and frees it after its last, where the eager executor rebuilds the whole unit before
  ``Bk``; so the unit counts, from its rebuild through ``Bk``, what those ops held over the
  rest (``rebuilt_bytes``, at most the unit: ``_rebuilds``, with the other runs' checkpoints
  at their storages alone, not what their ``F(k+1)`` held over), and the re-run op holds no
  transient of its own (its checkpoint and the units are live as ``Bk`` starts anyway) but
  what ``Bn`` held beyond the whole unit rebuilt (``rerun_peak_bytes``: Inductor re-running
  a BERT layer's attention, 592 KiB), no op predicted below what it held;
* nothing carried into the next forward (``carry_bytes: 0``), no gradient counted at the
  rebuild (``bwd_start_bytes: 0``: ``Bk``'s transient holds it);
* and the kept stages' units as the partition makes them beside a recomputed neighbour:
  it may save more of a kept stage (a ViT block: a layer norm's output where it saved its
  statistics), less (a GPT-2's positions, where it saves the mask made of them) or nothing
  (a ViT's embeddings, whose sum is the first block's checkpoint: each compile is fitted
  with the units it saved, so that one counted nothing there, not the chain's 24 KiB, which
  its neighbour's recomputed forward came out that much too small by), and a re-run may
  read a unit before its own backward does: each unit counts its largest over the fitting
  compiles (``saved_bytes``), needed from the latest stage that read it there
  (``need_from``), and a compile may move less of an offloaded unit than such a chain
  counts (nothing, where it saves nothing of it; recomputing nothing, as it was before it
  grew), never more (``SchedulePartitioner``); likewise a kept stage's op, or a run's own
  backward, that held more than its prediction in a fitting compile adds that to its transient
  (``fwd_peak_bytes``, ``bwd_peak_bytes``; a note in ``show`` lists them): T5's first stage
  makes the position bias that a run's checkpoint keeps.  A third compile recomputes every
  such stage, its neighbours recomputed too, and three more recompute pairs of neighbours
  with a kept stage between two pairs, so that each stage is recomputed beside a kept
  neighbour on one side and a recomputed one on the other (``_pairs``: where the joint ILP
  recomputed a GPT-2's blocks 3 and 4 alone, ``F4`` held 32 KiB over the chain fitted
  without them): these fit no run's costs, but what their units saved and their ops held
  over the costed chain count as the fitting compiles' do, a recomputed forward's excess in
  its recomputed transient (at most its kept one's).  The units are read from all these
  compiles first (a BERT's first attention is needed from its third's re-run, kept beside
  it), the runs' rebuilds are fitted against them (where a run is rebuilt follows where its
  unit is needed), and each compile's excess is then read against the chain so costed; at
  an op where a run is rebuilt it goes to that rebuild's row alone (``rerun_peak_bytes``, up
  to what the op held), which counts only where the run is recomputed (booked as the kept
  transient too, a Llama layer's backward recomputed beside a recomputed neighbour under
  Inductor, 12 MiB over, was paid by every schedule).

Two more compiles recompute every other such stage beside the others offloaded, and what
their ops held over the chain so costed is booked the same way (BERT under Inductor at
batch 4: 112 B at ``B5``, an offloaded stage's backward, which refused recomputation
outright before).  The chain offers it only where the model follows the compiled graph:
each op of these eight compiles must then hold at most what the costed chain books (a
recomputed forward cannot be booked past its kept one), and every offloaded unit must
move at most the chain's; otherwise the chain offers none, and a note says why. Nor does
it where what every schedule pays for it (a kept stage's transient beside a recomputed
neighbour, a unit that a neighbour's re-run reads needed from that re-run) leaves no
schedule with recomputation a budget under the smallest of the chain without it (a
Llama under Inductor, before ``compiled_copies.shared_saves``: 31.20 MiB offered, 26.23 MiB
without; ``_paying``); where it pays, a note says what it costs the schedules that only
offload. So a
whole-graph profile compiles the model nine times where it offers recomputation of three
stages or more. On this project's CPU (``experiments.compiled_recompute`` and the
seventeenth to twenty-first sessions' notes in ``experiments/results/README.md``) the
compiles followed the model on our GPT, transformers' GPT-2, BERT, ViT, T5, a Mixtral and a
U-Net under both backends; of these, measured in the twenty-second session, recomputation
lowers the smallest budget and is offered under Inductor on GPT-2 (6 of 6 stages), ViT (5
of 6), T5 (5 of 6) and the U-Net (7 of 12), under aot_eager on the U-Net (7 of 12), GPT-2
(6 of 6) and our GPT, and, once a storage a later stage's backward reads was in no unit,
on BERT and a transformers Llama under Inductor (18.68 MiB offered, 26.23 MiB without); not
on the Mixtral, whose smallest budget is its no-offload peak.  Inductor orders a
backward's kernels by what they read: a re-run whose checkpoint was there from the start was
fused into a kernel two stages before its own (a BERT layer's attention into another's
softmax backward: 451 KiB held over the kept stage between), so the partitioner hands each
run its checkpoint where the run begins (``compiled_copies.place_ready``).  What a re-run
makes that is not its stage's still floats: GPT-2's attention mask, made again once in
the backward for the first run that reads it and held to the last, is booked in the
transients of the stages between (160 KiB at ``B4`` in the nineteenth session's chain, 29
KiB since the units are read from every compile before the rebuilds are fitted).

It is a fit to the compiles sampled: a schedule whose runs none of them combined may hold
more at an op (a U-Net under aot_eager, its stage 3 recomputed alone: 64 KiB over at
``B3``), so ``offload solve --verify`` compiles and meters the schedule it writes
(``profiler/verify.py``).  Where it is offered, the prediction is tight: every block of the
GPT of ``experiments.compiled_recompute`` recomputed, 1.63 MiB predicted and held under
aot_eager, 1.58 MiB predicted for 1.52 MiB held under Inductor.
"""
from __future__ import annotations

import statistics
import warnings
from dataclasses import replace
from typing import Callable, Iterable

import torch

from offload.core.devices import running
from offload.errors import ChainMismatch, offload_cause
from offload.executor.compiled import SchedulePartitioner
from offload.executor.compiled_copies import UnitStorage, unit_needs
from offload.executor.marked import WARM_STEPS, MarkedRun
from offload.io.text import format_bytes
from offload.models.spec import ModelSpec
from offload.step.actions import Offload, Recompute
from offload.step.chain import Chain, Stage
from offload.step.chainfile import make_chain
from offload.step.memory import floor_offloads, memory_profile, op_name, smallest_feasible_budget
from offload.step.schedule import Schedule, make_schedule

ONE_GRAPH = ("--whole-graph needs the model's stages in one graph (a graph break is allowed only outside them, such "
             "as a loss compiled apart): find its graph breaks with torch._dynamo.explain(model)(*inputs) and remove "
             "them, or profile with --compile alone (a graph break at every stage boundary, for "
             "Offloaded(torch.compile(model)))")


def whole_graph_chain(chain: Chain, spec: ModelSpec, device: torch.device, backend: str, repeats: int, warmup: int,
                      tick: Callable[[str], None] = lambda _: None, recompute: bool = True) -> Chain:
    """The chain of ``spec.module`` compiled whole by ``backend``, cut where ``chain`` (its eager
    profile) is (module docstring).

    Args:
        chain: the eager profile: its cuts, names, kinds, platform and base are kept.
        spec: the model, on ``device``, with the batch and loss the profile used.
        backend: ``inductor`` or ``aot_eager``.
        repeats, warmup: timed steps and steps before them.
        recompute: offer recomputation where eight more compiles show the model follows it.

    Returns:
        The chain of the compiled graph.
    """
    L = chain.L
    partitioner = SchedulePartitioner(chain, make_schedule(chain, []), marks=True)
    run = _compiled(spec, partitioner, device, backend, max(warmup, WARM_STEPS))
    tick("compile")
    timed = [run.seconds() for _ in range(repeats)]
    seconds = [statistics.median(t[o] for t in timed) for o in range(2 * L)]
    peaks = run.peaks()
    tick("compiled step")
    compiled = _chain(chain, partitioner, backend, seconds, peaks, [sum(t) for t in timed])
    rerunnable = [k for k in range(1, L) if k in chain.recomputable and compiled.stage(k).saved_bytes]
    if recompute and rerunnable:
        return _paying(compiled, _with_recomputation(compiled, rerunnable, spec, device, backend, tick))
    return compiled


def _compiled(spec: ModelSpec, partitioner: SchedulePartitioner, device: torch.device, backend: str,
              steps: int) -> MarkedRun:
    """``spec.module`` compiled whole with ``partitioner``, after ``steps`` steps (the first
    compiles it and makes the gradients)."""
    with running(f"compiling {spec.description or 'the model'} as one graph", ONE_GRAPH), warnings.catch_warnings():
        # a graph break outside the stages (a loss compiled apart) is allowed: that graph is compiled plainly
        warnings.filterwarnings("ignore", "a graph of the compiled model runs none of the chain's stage boundaries")
        try:
            run = MarkedRun(spec, partitioner, device, backend)
            for _ in range(steps):
                run.step()
        except Exception as exc:
            raise offload_cause(exc) or exc
    return run


def _with_recomputation(chain: Chain, rerunnable: list[int], spec: ModelSpec, device: torch.device, backend: str,
                        tick: Callable[[str], None]) -> Chain:
    """``chain`` (of the compiled graph) with the ``rerunnable`` stages (the eager profile's
    verdict) recomputable as runs of one stage, their costs read from two more compiles with
    marks, each recomputing every other one of them, so that a run's neighbours are kept,
    and what one that recomputes them all, three that recompute pairs of them and then two
    that recompute every other one beside the others offloaded held over those costs booked
    too (module docstring, "recomputation"); then checked against those eight: where an op
    of these held more than the chain books (a recomputed forward over its kept one), or an
    offloaded unit moved more than the chain's, ``chain`` as it was, with a note saying so."""
    rerunnable, costed, metered = _fitted_offered(chain, rerunnable, spec, device, backend, tick)
    if not rerunnable:
        return _without_recomputation(chain, "each stage's recomputed forward held more than its kept one")
    over: dict[tuple[int, str], int] = {}
    if len(rerunnable) > 1:  # their neighbours recomputed, then offloaded: two more compiles
        for name, part, others in _halves(rerunnable):
            runs = [Recompute(k, k) for k in part]
            offloads = [o for o in floor_offloads(costed, runs) if o.stage in others]
            if runs and offloads:
                try:
                    measured = _metered(costed, offloads, runs, spec, device, backend)[0]
                except ChainMismatch as exc:  # with a neighbour recomputed, a unit is not one the chain moves
                    what = str(exc).split(": the model, its batch")[0]  # (its guess at why does not apply here)
                    return _without_recomputation(chain, f"compiled recomputing {name} ({', '.join(map(str, part))}) "
                                                         f"beside the rest offloaded: {what}")
                metered[f"{name}, the rest offloaded"] = (offloads, runs, measured)
                for where, nbytes in _held_over(costed, offloads, runs, measured, fits=False).items():
                    over[where] = max(nbytes, over.get(where, 0))
        tick("compiled recomputing every other one beside offloads")
    costed = _booked(costed, {}, over, "recomputing every other stage beside the others offloaded, an op held more "
                                       "than the compiles without offloads")
    for name, (offloads, runs, measured) in metered.items():
        predicted, _ = memory_profile(costed, offloads, runs)
        worst, o = max((measured[o] - int(predicted[o]), o) for o in range(2 * chain.L))
        if worst > 0:  # the model does not follow this compile's backward: no promise, so no recomputation
            return _without_recomputation(chain, f"compiled recomputing {name} ({', '.join(str(r.first) for r in runs)}"
                                                 f"), {op_name(chain, o)} held {format_bytes(worst)} over what the "
                                                 "chain books")
    return costed


def _paying(chain: Chain, costed: Chain) -> Chain:
    """``costed`` (recomputation offered), unless what its compiles held over ``chain`` (none
    recomputed), booked where every schedule pays it (a kept stage's transient beside a
    recomputed neighbour, a unit needed earlier by a neighbour's re-run), leaves no schedule
    with recomputation a budget under ``chain``'s smallest: then ``chain``, with a note (a
    Llama under Inductor before ``compiled_copies.shared_saves``: 31.20 MiB offered, 26.23 MiB without); where it
    pays, a note says what the schedules that only offload pay for it."""
    if not costed.recomputable:  # (not offered already: its note says why)
        return costed
    plain, offered = smallest_feasible_budget(chain), smallest_feasible_budget(costed, recompute=True)
    if offered > plain:
        return _without_recomputation(chain, f"what its compiles held over the chain, booked for every schedule, would "
                                             f"raise the smallest budget by {format_bytes(offered - plain)}, from "
                                             f"{format_bytes(plain)} to {format_bytes(offered)}, and no schedule "
                                             "recomputing would go below it", placed=False)
    paid = smallest_feasible_budget(costed) - plain
    if paid <= 0:
        return costed
    note = (f"offering recomputation raised the smallest budget of a schedule that only offloads by "
            f"{format_bytes(paid)}, from {format_bytes(plain)} to {format_bytes(plain + paid)} (what its compiles held "
            "over, booked for every schedule); profile with --no-recompute to solve for such schedules")
    return replace(costed, source={**costed.source, "notes": [*costed.source.get("notes", []), note]})


def _fitted_offered(chain: Chain, rerunnable: list[int], spec: ModelSpec, device: torch.device, backend: str,
                    tick: Callable[[str], None]) -> tuple[list[int], Chain, dict]:
    """``_fitted`` over the two halves of ``rerunnable``, fitted again without the stages a
    fit does not offer (a recomputed forward that held more than the kept one) until it
    offers every stage it fitted: a compile that recomputed a stage the chain keeps measured
    a step the chain does not predict, neither to fit the others' costs from (BERT under
    Inductor: every op after its recomputed embedding norm 7.5 KiB over) nor to check them
    against.  Returns the stages offered (none: each recomputed forward held more), the
    costed chain and the fitting compiles."""
    while True:
        parts = [(name, part) for name, part, _ in _halves(rerunnable) if part]
        every = [("every stage", rerunnable)] if len(parts) > 1 else []
        costed, metered = _fitted(chain, rerunnable, parts, every + _pairs(rerunnable), spec, device, backend, tick)
        offered = [k for k in rerunnable if k in costed.recomputable]
        if offered == rerunnable or not offered:
            return offered, costed, metered
        rerunnable = offered


def _halves(stages: list[int]) -> list[tuple[str, list[int], list[int]]]:
    """Every other one of ``stages`` and the others, each by name with the rest: the compiles
    that recompute one half keep each run's neighbours."""
    return [("every other stage", stages[0::2], stages[1::2]), ("the other stages", stages[1::2], stages[0::2])]


def _pairs(stages: list[int]) -> list[tuple[str, list[int]]]:
    """Three compiles recomputing pairs of neighbours among ``stages``, a kept one between two
    pairs, each by name with its stages: together they recompute each stage beside a kept
    neighbour on one side and a recomputed one on the other, both ways round (the joint ILP
    recomputing a GPT-2's blocks 3 and 4 alone under Inductor: 32 KiB over at ``F4``, which
    neither the halves nor every stage recomputed showed).  None for fewer than three."""
    if len(stages) < 3:
        return []
    out = []
    for first in range(3):
        pairs = [stages[i:i + 2] for i in range(first, len(stages) - 1, 3)]
        if pairs:
            out.append((f"pairs from stage {pairs[0][0]}", [k for pair in pairs for k in pair]))
    return out


def _fitted(chain: Chain, rerunnable: list[int], parts: list[tuple[str, list[int]]],
            checks: list[tuple[str, list[int]]], spec: ModelSpec, device: torch.device, backend: str,
            tick: Callable[[str], None]) -> tuple[Chain, dict[str, tuple[list[Offload], list[Recompute], list[int]]]]:
    """``chain`` with the ``rerunnable`` stages costed from one compile per part recomputing
    that part's stages, and per compile (by the part's name) its schedule and its ops' memory.
    The ``checks``' compiles (every stage recomputed, pairs of them) cost no run: what their
    units saved and their ops held over the costed chain counts as the parts' does (a ViT
    under Inductor, all its blocks recomputed: one more layer norm's statistics in a block's
    backward, 520 B).  The units are read from every compile first, and the runs' rebuilds
    and each compile's excess then against them: a unit needed from a later stage's re-run
    (a BERT's first attention, from its third's, kept beside it) is rebuilt from there when
    recomputed, and its rebuild fitted so (fitted from its own stage, its re-run's 120 KiB
    at ``B3`` was booked at ``B7``)."""
    base = _with_fields(chain, {k: dict(recomputable=True, rerun_output=False, carry_bytes=0, bwd_start_bytes=0)
                                for k in rerunnable})
    fields: dict[int, dict] = {}
    need: dict[int, int] = {}
    largest: dict[int, int] = {}
    unbooked: dict[int, int] = {}  # by run: what F(k+1) held over its checkpoint's storages (_fit_runs)
    metered: dict[str, tuple[list[Offload], list[Recompute], list[int]]] = {}
    compiles: list[tuple[list[int], list[Recompute], list[int], dict[int, dict], bool]] = []
    for name, part in [*parts, *checks]:
        fits = (name, part) in parts
        if not fits and not all(fields[k].get("recomputable", True) for k in rerunnable):
            return _with_fields(base, fields), metered  # a stage not offered: fitted again without it (_fitted_offered)
        runs = [Recompute(k, k) for k in part]
        measured, partitioner = _metered(base, [], runs, spec, device, backend)
        metered[name] = ([], runs, measured)
        # a kept unit that the partition changes with a neighbour recomputed (what it saves of a
        # layer norm, of a mask) counts its largest; one a re-run reads is needed from its stage
        kept = [s for s in partitioner.counted if s.unit not in part]
        for k, n in unit_needs(kept).items():
            need[k] = max(n, need.get(k, base.stage(k).need_from))
        here = _unit_sizes(kept, (k for k in range(1, base.L + 1) if k not in part))  # (one it saved nothing of: 0)
        sizes = {k: dict(saved_bytes=unit["saved_bytes"]) for k, unit in here.items()}
        for k, unit in here.items():
            largest[k] = max(unit["saved_bytes"], largest.get(k, base.stage(k).saved_bytes))
        if fits:
            _fit_runs(base, part, runs, partitioner, measured, sizes, fields, unbooked)
        compiles.append((part, runs, measured, sizes, fits))
        tick(f"compiled recomputing {', '.join(map(str, part))}")
    needs = {k: dict(need_from=n) for k, n in need.items()}

    def costed(sizes: dict[int, dict], part: list[int]) -> Chain:
        return _with_fields(base, {k: {**needs.get(k, {}), **sizes.get(k, {}), **(fields[k] if k in part else {})}
                                   for k in range(1, base.L + 1)})
    for part, runs, measured, sizes, fits in compiles:
        if fits and all(fields[k].get("recomputable", True) for k in part):
            for k, rebuild in _rebuilds(costed(sizes, part), runs, measured, unbooked).items():
                fields[k].update(rebuild)
    for k in set(need) | set(largest):
        fields[k] = {**fields.get(k, {}), "need_from": need.get(k, base.stage(k).need_from),
                     "saved_bytes": largest.get(k, base.stage(k).saved_bytes)}
    # a kept stage's op beside a recomputed neighbour, and a run's own backward, count their
    # largest too: what one held over the chain so costed in a compile is added to its
    # transient (T5's first stage makes the position bias a run's checkpoint keeps); so does
    # a recomputed forward where its neighbours are recomputed too
    over: dict[tuple[int, str], int] = {}
    for part, runs, measured, _, fits in compiles:
        if all(fields[k].get("recomputable", True) for k in part):
            for where, nbytes in _held_over(_with_fields(base, fields), [], runs, measured, fits).items():
                over[where] = max(nbytes, over.get(where, 0))
    fitted = _booked(base, fields, over, "recomputing a neighbour or itself, a stage's op held more than kept")
    return fitted, metered


def _held_over(chain: Chain, offloads: list[Offload], runs: list[Recompute], measured: list[int], fits: bool
               ) -> dict[tuple[int, str], int]:
    """What each op of a compile (``offloads``, ``runs``; ``measured`` its ops' memory) held
    over ``chain``'s prediction, by the transient that books it: ``(stage, field)`` -> bytes.
    A kept or offloaded stage's op books it in its own transient (``fwd_peak_bytes``,
    ``bwd_peak_bytes``), a recomputed forward in its recomputed transient (not where the
    compile ``fits`` that run: ``_fit_runs`` did), and an op where a run is rebuilt in that
    rebuild's row alone (``rerun_peak_bytes``, up to what the op held, whichever row bound),
    which counts only where the run is recomputed (booked as the kept transient too, a
    Llama layer's backward recomputed beside a recomputed neighbour under Inductor, 12 MiB
    over, was paid by every schedule)."""
    L = chain.L
    recomputed = {r.first for r in runs}
    predicted, rebuilt = memory_profile(chain, offloads, runs)
    rows: dict[int, tuple[int, int]] = {}  # by op, the run rebuilt there whose row holds most, and that
    for n, k, nbytes in rebuilt:
        if nbytes >= rows.get(2 * L - n, (0, -1))[1]:
            rows[2 * L - n] = (k, nbytes)
    over: dict[tuple[int, str], int] = {}
    for j in range(1, L + 1):
        for o, key in ((j - 1, "fwd_peak_bytes"), (2 * L - j, "bwd_peak_bytes")):
            if measured[o] <= predicted[o]:
                continue
            if key == "fwd_peak_bytes" and j in recomputed:
                if fits:
                    continue
                key = "recomputed_fwd_peak_bytes"
            where, nbytes = (j, key), measured[o] - int(predicted[o])
            if o in rows:
                where, nbytes = (rows[o][0], "rerun_peak_bytes"), measured[o] - rows[o][1]
            over[where] = max(nbytes, over.get(where, 0))
    return over


def _booked(base: Chain, fields: dict[int, dict], over: dict[tuple[int, str], int], why: str) -> Chain:
    """``base`` with ``fields`` and what ``over`` (``_held_over``) says each transient held more
    added to it, into ``fields`` too (a recomputed forward's at most its kept one's: more is
    refused by the check), with a note listing them after ``why``."""
    for (j, key), nbytes in sorted(over.items(), key=lambda item: item[0][1] == "recomputed_fwd_peak_bytes"):
        stage, mine = _with_fields(base, fields).stage(j), fields.setdefault(j, {})
        if key == "recomputed_fwd_peak_bytes":
            mine[key] = min(stage.recomputed_fwd_peak + nbytes, stage.fwd_peak_bytes)
        elif key == "rerun_peak_bytes":
            mine[key] = (stage.fwd_peak_bytes if stage.rerun_peak_bytes is None else stage.rerun_peak_bytes) + nbytes
        else:
            mine[key] = getattr(stage, key) + nbytes
    fitted = _with_fields(base, fields)
    if not over:
        return fitted
    what = {"recomputed_fwd_peak_bytes": " recomputed", "rerun_peak_bytes": " rebuilt"}

    def op(j: int, key: str) -> int:  # (a rebuild's row: at its unit's need)
        return j - 1 if "fwd" in key else 2 * base.L - (fitted.stage(j).need_from if "rerun" in key else j)
    ops = ", ".join(f"{op_name(base, op(j, key))}{what.get(key, '')} {format_bytes(n)}"
                    for (j, key), n in sorted(over.items()))
    return replace(fitted, source={**fitted.source, "notes": [*fitted.source.get("notes", []), f"{why}; booked: {ops}"]})


def _fit_runs(base: Chain, part: list[int], runs: list[Recompute], partitioner: SchedulePartitioner,
              measured: list[int], sizes: dict[int, dict], fields: dict[int, dict], unbooked: dict[int, int]) -> None:
    """Each run of ``part`` costed from the compile that recomputed it (``measured``, made by
    ``partitioner``; ``sizes`` the kept units there): its checkpoint, its recomputed forward's
    transient, into ``fields`` (or not offered: its forward held more than kept); what
    ``F(k+1)`` held over the checkpoint's storages, into ``unbooked`` too."""
    costs = {k: dict(input_bytes=whole + shared, input_own_bytes=whole)
             for k, (whole, shared) in partitioner.checkpoints.items()}
    fitted = _with_fields(base, {**sizes, **costs})
    predicted, _ = memory_profile(fitted, [], runs)
    for k in part:
        # what F(k+1) holds over its prediction stays until the run is rebuilt: booked with
        # the checkpoint (not a storage that offloading the checkpoint moves)
        unbooked[k] = max(0, measured[k] - int(predicted[k]))
        fwd_peak = int(fitted.rfp[k]) + measured[k - 1] - int(predicted[k - 1])  # Fk's op as measured
        fields[k] = {**costs[k], "input_bytes": costs[k]["input_bytes"] + unbooked[k],
                     "recomputed_fwd_peak_bytes": min(max(0, fwd_peak), base.stage(k).fwd_peak_bytes)}
        if fwd_peak > base.stage(k).fwd_peak_bytes:  # recomputed, Fk held more than kept: not offered
            fields[k] = dict(recomputable=False, rerun_output=True, carry_bytes=None)


def _without_recomputation(chain: Chain, why: str, placed: bool = True) -> Chain:
    """``chain`` offering no recomputation, with a note saying ``why`` (``placed``: a re-run the
    compiler placed otherwise than the model follows)."""
    note = f"recomputation not offered: {why}" + (" (a compiled re-run placed otherwise than the model follows: "
                                                  "experiments.compiled_recompute)" if placed else "")
    return replace(chain, source={**chain.source, "notes": [*chain.source.get("notes", []), note]})


def metered(chain: Chain, schedule: Schedule, spec: ModelSpec, device: torch.device,
            backend: str | None = None) -> tuple[list[int], SchedulePartitioner]:
    """Each op's memory in a step of ``spec.module`` compiled whole by ``backend`` (the
    chain's) with ``schedule`` and the profiler's marks, as the profile measures its own
    compiles (``offload solve --verify`` meters its schedule so), and the partitioner that
    made its graphs (what it saves: the units' storages, the runs' checkpoints)."""
    partitioner = SchedulePartitioner(chain, schedule, marks=True)
    return _compiled(spec, partitioner, device, backend or chain.recipe.compile, WARM_STEPS).peaks(), partitioner


def _metered(chain: Chain, offloads: list[Offload], runs: list[Recompute], spec: ModelSpec, device: torch.device,
             backend: str) -> tuple[list[int], SchedulePartitioner]:
    """``metered`` with ``offloads`` and ``runs`` (a compile the profile samples)."""
    return metered(chain, make_schedule(chain, offloads, recompute=runs), spec, device, backend)


def _rebuilds(chain: Chain, runs: list[Recompute], measured: list[int], unbooked: dict[int, int]) -> dict[int, dict]:
    """Per run (by its stage), its rebuild's fields, fitted to the ops of a compile that ran
    ``runs``, ``measured`` its ops' memory: the compiled backward re-runs each op right before
    its reader, inside ``Bk``, so the re-run op holds no transient of its own
    (``rerun_peak_bytes: 0``: what its checkpoint and the units hold is live as ``Bk``
    starts) and the unit counts what ``Bn .. Bk`` held over the rest (``rebuilt_bytes``, no
    more than the unit), no op predicted below what it held; where ``Bn`` held more than
    with the whole unit rebuilt (Inductor re-running a BERT layer's attention: 592 KiB), the
    excess is the re-run's transient (``rerun_peak_bytes``), which the rebuild's row at ``Bn``
    books.  Each run is fitted with the other runs' checkpoints at their storages alone: what
    a neighbour's ``F(k+1)`` held over (``unbooked``, by run) is booked with its checkpoint
    until its rebuild, but may be gone long before (a ViT's embeddings re-run: its first
    block's forward held 64 KiB more, gone at the next); fitted beside it, a rebuild came
    out that much short wherever the neighbour is kept (a ViT block's at ``B4``, 64 KiB)."""
    L = chain.L
    fields: dict[int, dict] = {r.first: {"rerun_peak_bytes": 0} for r in runs}
    window = {k: range(2 * L - int(chain.need[k]), 2 * L - k + 1) for k in fields}  # Bn .. Bk: the unit rebuilt

    def predicted_for(k: int, fitted: dict[int, dict]) -> tuple[list, list]:  # run k's fit: the others' storages
        others = {j: {**fitted[j], "input_bytes": int(chain.stage(j).input_bytes) - unbooked.get(j, 0)}
                  for j in fitted if j != k}
        return memory_profile(_with_fields(chain, {**fitted, **others}), [], runs)
    spares = {k: min(int(predicted_for(k, fields)[0][o]) - measured[o] for o in ops) for k, ops in window.items()}
    for k, spare in spares.items():
        fields[k]["rebuilt_bytes"] = max(0, int(chain.a[k]) - max(0, spare))
    for k, ops in window.items():  # units rebuilt at one op share its spare: each back whole where it ran short
        predicted = predicted_for(k, fields)[0]
        if any(int(predicted[o]) < measured[o] for o in ops):
            fields[k]["rebuilt_bytes"] = None
    for k in list(fields):  # (each run one stage: its row's bytes with no transient of its own)
        for n, j, nbytes in predicted_for(k, fields)[1]:
            if j == k:
                fields[k]["rerun_peak_bytes"] = max(0, measured[2 * L - n] - nbytes)
    return fields


def _unit_sizes(storages: list[UnitStorage], units: Iterable[int]) -> dict[int, dict[str, int]]:
    """Per unit (of ``units``; one of which ``storages``, a partition's, hold none: nothing),
    its bytes, and the bytes and last stage of those that a forward two or more stages later
    still reads (the graph holds them through it, moved or not), and where its copies move
    less than it frees (each storage's extent), what they move: its ``Stage`` fields."""
    out = {k: dict(saved_bytes=0, held_bytes=0, held_until=0) for k in units}
    moved = dict.fromkeys(out, 0)
    for s in storages:
        fields = out[s.unit]
        fields["saved_bytes"] += s.nbytes
        moved[s.unit] += s.nbytes if s.moved is None else s.moved
        if s.held_until >= s.unit + 2:
            fields["held_bytes"] += s.nbytes
            fields["held_until"] = max(fields["held_until"], s.held_until)
    for k, fields in out.items():
        if moved[k] < fields["saved_bytes"]:
            fields["moved_bytes"] = moved[k]
    return out


def _with_fields(chain: Chain, fields: dict[int, dict]) -> Chain:
    return replace(chain, stages=tuple(replace(s, **fields.get(k, {})) for k, s in enumerate(chain.stages, 1)))


def _chain(chain: Chain, partitioner: SchedulePartitioner, backend: str, seconds: list[float], peaks: list[int],
           steps: list[float]) -> Chain:
    L = chain.L
    sizes = _unit_sizes(partitioner.counted, range(1, L + 1))
    units = [0] + [sizes[k]["saved_bytes"] for k in range(1, L + 1)]
    need = unit_needs(partitioner.counted)
    stages = []
    for k, old in enumerate(chain.stages, 1):
        before = sum(units[1:k])
        stages.append(Stage(name=old.name, kind=old.kind, fwd_s=seconds[k - 1], bwd_s=seconds[2 * L - k],
                            fwd_peak_bytes=max(units[k], peaks[k - 1] - before),
                            bwd_peak_bytes=max(0, peaks[2 * L - k] - before - units[k]), need_from=need.get(k, k),
                            recomputable=False, **sizes[k]))
    steps = sorted(steps)
    source = {**chain.source, "graph": f"one graph compiled by {backend}: units, times and memory measured there "
                                      "(offload.profiler.compiled)",
              "notes": ["profiled as one compiled graph: no encoder runs in it, each recomputed stage is a run of "
                        "its own; train it with compile_scheduled or offload train"],
              "step_s": {"median": statistics.median(steps), "min": steps[0], "max": steps[-1]},
              "eager_step_s": chain.source.get("step_s")}
    # the step a plain compile of the model takes, as `train --compare` times it for the pace: this
    # graph's own (no saved-tensor hook runs in it; its stage marks only read the clock)
    source["plain_step_s"] = source["step_s"]
    recipe = replace(chain.recipe, compile=backend, whole_graph=True)
    return make_chain(chain.name, stages, chain.platform, chain.base_bytes, source, recipe, chain.workspace_bytes)
