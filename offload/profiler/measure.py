"""Measure a staged model's training step, stage by stage (docs/profiling.md).

One *memory pass* and several *timing passes* of the same step (forward, loss, backward;
the optimizer's update is outside the chain and timed apart), on the user's own module
with stage boundaries at its cut sites (``offload.core.staging``):

* memory pass: a meter (``offload.core.meters``) is read at every stage boundary, and the
  shared ``UnitTracker`` attributes every storage saved for backward to its unit (the first
  stage that saves it) and finds each unit's ``need_from``.  With ``M0`` the bytes live
  when the step starts (weights, gradients, optimizer state and the batch, which the
  training loop holds through the step) and ``U_j`` the units, the transients are
  ``fwd_peak_i = peak(F_i) - M0 - sum_{j<i} U_j`` and ``bwd_peak_i = peak(B_i) - M0 -
  sum_{j<=i} U_j``: exactly what the chain model adds on top of the resident units.  The
  turn (``F_L`` ends, ``B_L`` starts) is when the model's output gets its gradient, as in
  the executor (``offload.core.staging``): the loss, and the loss's own backward when the
  loss is computed outside the model, count in ``F_L``.  The model's output is not held
  through the backward (a loop holds the loss).  Each stage's module calls are recorded
  too (``offload.core.rerun``): whether the executor can re-run the stage, and its
  ``input_bytes`` (its input and the gradient-free tensors its calls read: what a
  recomputation from it holds); and ``bwd_start_i = live(B_i starts) - M0 - sum_{j<=i} U_j``,
  the part of ``B_i``'s transient already live before it runs (the gradient flowing in),
  which a recomputation rebuilt at ``B_i``'s start finds there;
* timing passes: warm-up steps, then ``repeats`` steps timed at the boundaries (CUDA events
  or ``perf_counter``); each stage's time is the median over the repeats, and the spread
  of the repeats is reported (``source.timing``).

Gradients are kept allocated between steps (``zero_grad(set_to_none=False)``), so that
they are part of the constant ``base_bytes`` as the chain model assumes.
"""
from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from offload.core import casts
from offload.core.devices import deterministic_kernels, make_optimizer, persistent_tensors
from offload.core.meters import UNCOUNTED, Clock, CpuMeter, make_meter, timed
from offload.core.rerun import NotRerunnable, StageRecorder, written_later
from offload.core.selective import KeptOutputs
from offload.core.staging import StageListener, Staging, compiled
from offload.core.units import Saved, UnitTracker, distinct_bytes, plain, storage_key
from offload.errors import ModelError
from offload.io.text import format_bytes
from offload.models.spec import ModelSpec, tensors_in
from offload.step.chain import staying_saves


@dataclass
class StageMeasurement:
    fwd_s: float
    bwd_s: float
    saved_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    need_from: int
    held_bytes: int = 0
    held_until: int = 0
    carry_bytes: int = 0
    input_bytes: int = 0
    recomputable: bool = True
    bwd_start_bytes: int = 0
    recomputed_fwd_peak_bytes: int = 0
    input_carried_bytes: int = 0  # of input_bytes, storages of the unit that carry_bytes counts too ...
    input_held_bytes: int = 0  # ... and held_bytes
    fwd_host_s: float = 0.0  # the host's time to issue the forward (CUDA)
    bwd_host_s: float = 0.0
    cast_bytes: int = 0  # the weight casts the forward makes and the backward makes again
    recast_s: float = 0.0  # what making them again takes (timed on their own)
    rerun_held_bytes: int = 0  # of input_bytes, what its re-run holds that the stage before's does not
    rerun_output: bool = True  # its re-run rebuilds its output (else it can only end a recomputed run)
    input_own_bytes: int = 0  # of input_bytes, the input's own storage (what an offloaded checkpoint moves)
    shared_saves: tuple[int, ...] = ()  # its first saves a stage after the next saves too
    dropped_saves: tuple[int, ...] = ()  # its first saves gone as the forward ends (no backward reads them)
    held_saves: tuple[int, ...] = ()  # the storages held_bytes counts ...
    held_read_at: int = 0  # ... and the first forward after the next that reads one (0: none)
    storages: int = 0  # the storages of its unit
    saves: int = 0  # the saves of those storages in a step
    fwd_start_bytes: int = 0  # of fwd_peak_bytes, what is live as the forward starts
    carried_late_bytes: int = 0  # of carry_bytes, what dies only as F(i+2) starts (``Holding.late``) ...
    input_late_bytes: int = 0  # ... and of that, the input's storages (a run's checkpoint holds them)
    held_late_bytes: int = 0  # of held_bytes, what dies only as F(held_until+1) starts (``Holding.held_late``) ...
    input_held_late_bytes: int = 0  # ... and of that, the input's storages
    input_prev_bytes: int = 0  # of input_bytes, storages of the unit before (a run starting here holds them once beside it) ...
    input_prev_held_bytes: int = 0  # ... and of that, what the unit before's held part counts
    carried_early_bytes: int = 0  # of the unit, not in carry_bytes, what dies as F(i+1) starts (``Holding.early``)


@dataclass
class MemoryPass:
    """What one step read at the stage boundaries (``StepRunner.memory_pass``)."""

    m0: int  # bytes live as the step starts
    fwd_peaks: list[int]  # peak of each F_i
    bwd_peaks: list[int]  # peak of each B_i
    saved: list[int]  # bytes of each unit
    need: list[int]  # need_from of each unit
    peak_ops: list[int] | None  # the op at which each F_i peaked (CPU only)
    op_lives: list[int] | None  # the bytes live as each forward op (1, 2, ...: index 0, 1, ...) made its outputs (CPU only)
    starts: list[int]  # the bytes live as each F_i starts
    bwd_starts: list[int]  # the bytes live as each B_i starts (the gradient flowing in is new)
    inputs: list[tuple[int, int]]  # input_bytes of each stage, and of it the input's own storage
    own: list[dict[int, int]]  # per stage, index -> bytes of its checkpoint's storages in its own unit
    new_held: list[int]  # per stage, bytes its re-run holds that the stage before's does not
    output_rebuilt: list[bool]  # per stage, whether its re-run rebuilds its output (else it can only end a run)
    rerun: list[str | None]  # per stage, why the executor cannot re-run it (None: it can)
    workspace: int = 0  # of m0, the bytes no tensor holds (CUDA: workspaces, the allocator's rounding)
    casts: list[list[casts.Recast]] = field(default_factory=list)  # per stage, the weight casts not saved
    shared_casts: bool = False  # a weight cast in two stages (``_CastsMade``) ...
    casts_twice: bool = False  # ... or twice in the forward
    shared_saves: list[tuple[int, ...]] = field(default_factory=list)  # per stage, found by the pass (``UnitTracker.shared_saves``)
    dropped_saves: list[tuple[int, ...]] = field(default_factory=list)  # and ``UnitTracker.dropped_saves``
    storages: list[int] = field(default_factory=list)  # per stage, the storages of its unit
    saves: list[int] = field(default_factory=list)  # per stage, the saves of its unit's storages
    lets_go: list[bool] = field(default_factory=list)  # per stage, ``_Recording.lets_go``
    prev: list[dict[int, int]] = field(default_factory=list)  # per stage, ``own``'s in the unit before

    def widened(self, other: "MemoryPass") -> "MemoryPass":
        """This pass with each stage's peak (over its own ``m0``) the larger of the two passes'
        (the same step under other kernels: their workspaces differ), and the larger workspace."""
        lift = self.m0 - other.m0
        return replace(self, fwd_peaks=[max(a, b + lift) for a, b in zip(self.fwd_peaks, other.fwd_peaks)],
                       bwd_peaks=[max(a, b + lift) for a, b in zip(self.bwd_peaks, other.bwd_peaks)],
                       workspace=max(self.workspace, other.workspace))


@dataclass
class Measurement:
    stages: list[StageMeasurement]
    base_bytes: int
    base_parts: dict[str, int]
    step_s: list[float]  # forward + backward of each timed repeat
    optimizer_step_s: float
    notes: list[str] = field(default_factory=list)
    workspace_bytes: int = 0  # of base_bytes, held by no tensor (``Chain.workspace_bytes``)
    casts_cleared: bool = False  # autocast's cache cleared at every stage boundary (``Recipe.casts_cleared``)
    casts_uncached: bool = False  # autocast's cache off in the forward (``Recipe.casts_uncached``)
    plain_step_s: list[float] = field(default_factory=list)  # the step as plain PyTorch runs it, beside each repeat


class Boundaries(StageListener):
    """Calls ``on_boundary`` where an op ends: the inner forward boundaries, the turn (the first
    backward boundary) and the inner backward ones; keeps the tracker's current stage."""

    def __init__(self, L: int, on_boundary: Callable[[], None], tracker: UnitTracker | None = None) -> None:
        self.L, self.on_boundary, self.tracker = L, on_boundary, tracker

    def forward_boundary(self, k: int) -> None:
        if k < self.L:
            self.on_boundary()
            if self.tracker is not None:
                self.tracker.stage = k + 1

    def backward_boundary(self, k: int) -> None:
        self.on_boundary()


class _Recording(Boundaries):
    """The memory pass's listener: also records every stage's calls (can it be re-run, what
    would a re-run hold)."""

    def __init__(self, L: int, on_boundary: Callable[[], None], tracker: UnitTracker, device: torch.device) -> None:
        super().__init__(L, on_boundary, tracker)
        self.device = device
        self.recorder: StageRecorder | None = None
        self.inputs, self.why = [(0, 0)] * L, ["the last stage's backward follows its forward at once"] * L
        self.own: list[dict[int, int]] = [{} for _ in range(L)]  # per stage, its checkpoint's storages in its unit
        self.prev: list[dict[int, int]] = [{} for _ in range(L)]  # per stage, its checkpoint's storages in the unit before
        self.new_held = [0] * L  # per stage, bytes its re-run holds that the stage before's does not
        self.output_rebuilt = [True] * L  # per stage, whether its re-run rebuilds its output
        self.lets_go = [False] * L  # per stage, whether the model's code let go inside it of what its re-run holds
        self.writes = _Writes()  # enter it around the forward
        self.previous: dict[int, weakref.ref] = {}  # the storages the stage before's re-run holds, by key

    def forward_start(self) -> None:
        self._start(1, None)

    def stage_output(self, k: int, x: torch.Tensor, opening: bool) -> None:
        recorder, self.recorder = self.recorder, None
        self.lets_go[k - 1] = recorder.let_go()
        try:
            self.output_rebuilt[k - 1] = recorder.finish(x).output is not None
            self.why[k - 1] = None
            self.inputs[k - 1] = (recorder.input_bytes + recorder.held_bytes(), recorder.input_bytes)
            for key in recorder.keys():
                record = self.tracker.record_of(key)
                if record is not None and record.unit == k:
                    self.own[k - 1][record.index] = record.nbytes
                elif record is not None and record.unit == k - 1:
                    self.prev[k - 1][record.index] = record.nbytes
            self.writes.watch(k, recorder.versions())
        except NotRerunnable as exc:
            self.why[k - 1] = str(exc)
        self.new_held[k - 1] = self._new_held(recorder)
        if k + 1 < self.L:
            self._start(k + 1, x, opening)

    def _new_held(self, recorder: StageRecorder) -> int:
        """Bytes the stage's re-run holds that the stage before's does not (``rerun_held_bytes``),
        storages compared by identity (a dead one's key may be another's by now)."""
        held = recorder.held_storages()
        new = sum(n for key, (storage, n) in held.items()
                  if storage is None or key not in self.previous or self.previous[key]() is not storage)
        self.previous = {key: weakref.ref(storage) for key, (storage, _) in held.items() if storage is not None}
        return new

    def _start(self, k: int, x: torch.Tensor | None, opening: bool = False) -> None:
        self.recorder = StageRecorder(k, x, self.device, self.tracker.excluded, keep=False, opening=opening,
                                      code=self.encloses(k))

    def saved(self) -> None:
        if self.recorder is not None:
            self.recorder.saved()

    def close(self) -> None:
        """The forward ended: a stage whose input or held tensor the forward wrote in place
        after it cannot be re-run."""
        if self.recorder is not None:
            self.recorder.close()
        for k in self.writes.written:
            if self.why[k - 1] is None:
                self.why[k - 1] = (f"stage {k} cannot be re-run: the forward writes in place, after the stage, a tensor "
                                   "its re-run reads")


class _Writes(TorchDispatchMode):
    """The stages whose re-run reads a tensor (its input, a held one) that the forward writes
    in place after the stage ended (an op whose schema writes an argument): storages are
    watched by identity from the stage's end, so one that dies before the forward ends is
    judged too (the executor would have kept it, written, for the re-run)."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: dict[int, tuple[weakref.ref, set[int]]] = {}  # storage key -> (storage, stages)
        self.written: set[int] = set()

    def watch(self, stage: int, versions: list[tuple[weakref.ref, int]]) -> None:
        if written_later(versions):  # written inside the stage, after it was read
            self.written.add(stage)
        for ref, _ in versions:
            t = ref()
            if t is not None:
                key, storage = storage_key(t), t.untyped_storage()
                entry = self.watched.get(key)
                if entry is None or entry[0]() is not storage:  # new, or a dead one's key reused
                    entry = self.watched[key] = (weakref.ref(storage), set())
                entry[1].add(stage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.watched and func._schema.is_mutable:
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                    entry = self.watched.get(storage_key(value))
                    if entry is not None and entry[0]() is value.untyped_storage():
                        self.written.update(entry[1])
        return func(*args, **kwargs)


class _CastsMade(TorchDispatchMode):
    """The stages in which each weight was cast (autocast's ``_to_copy`` of a parameter), and
    how many times: with the cache cleared at the boundaries, a weight cast in two of them
    (read by both); with no cache, a weight cast twice (read by two ops)."""

    def __init__(self, tracker: UnitTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.stages: dict[int, set[int]] = {}
        self.count: Counter[int] = Counter()

    @property
    def shared(self) -> bool:
        return any(len(s) > 1 for s in self.stages.values())

    @property
    def twice(self) -> bool:
        return any(n > 1 for n in self.count.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args and isinstance(args[0], torch.nn.Parameter):
            self.stages.setdefault(id(args[0]), set()).add(self.tracker.stage)
            self.count[id(args[0])] += 1
        return func(*args, **(kwargs or {}))


class StepRunner:
    """The user's module with its stage boundaries, its batch and optimizer on one device:
    runs and measures training steps."""

    def __init__(self, staging: Staging, spec: ModelSpec, device: torch.device, optimizer: str, lr: float = 1e-4) -> None:
        self.staging, self.spec, self.device = staging, spec, device
        self.params = [p for p in spec.module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(optimizer, self.params, lr)
        self.staying: dict[int, tuple[int, ...]] = {}  # stage -> its first saves in no unit (shared or dropped)

    def tracker(self, excluded: list[torch.Tensor]) -> UnitTracker:
        """The units' rule for a pass: ``excluded`` never in one, nor the storages ``staying`` names."""
        return UnitTracker(self.device, excluded, self.staying)

    @property
    def L(self) -> int:
        return self.staging.L

    @contextlib.contextmanager
    def batch(self) -> Iterator[tuple[tuple, dict]]:
        """A fresh copy of the batch, held through the step as a training loop holds it."""
        args, kwargs = self.spec.batch()
        yield args, kwargs
        del args, kwargs

    def forward(self, args: tuple, kwargs: dict, listener: StageListener | None,
                pack: Callable[[torch.Tensor], Any] | None = None,
                unpack: Callable[[Any], torch.Tensor] = casts.unpack) -> torch.Tensor:
        """Forward and loss of one step; ``pack`` sees every tensor saved for backward.

        The hooks run behind ``torch.compiler.disable``, as the executor's do: under a compiled
        model with graph breaks, Dynamo would otherwise compile them too, again for each new kind
        of tensor they see.  ``pack`` defaults to the executor's treatment of weight casts
        (dropped, made again when read), which every pass shares."""
        hooks = torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(pack or casts.pack),
                                                         torch.compiler.disable(unpack))
        listening = self.staging.listening(listener) if listener else contextlib.nullcontext()
        with listening, hooks, self.spec.autocasting():
            return self.spec.loss(self.spec.module(*args, **kwargs))

    def zero_grads(self) -> None:
        self.spec.zero_grads(self.params)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warmup(self, steps: int) -> float:
        """Full steps (optimizer included) so that gradients and optimizer state exist.

        Returns the seconds of the last optimizer update (outside the chain, reported apart)."""
        update_s = 0.0
        for _ in range(max(1, steps)):
            with self.batch() as (args, kwargs):
                self.forward(args, kwargs, None).backward()
            if self.optimizer is not None:
                self.sync()
                t = time.perf_counter()
                self.optimizer.step()
                self.sync()
                update_s = time.perf_counter() - t
            self.zero_grads()
        return update_s

    def plain_step(self) -> float:
        """One step (forward, loss, backward) timed as plain PyTorch runs it: no saved-tensor hook,
        no listener, autocast's cache as it is.  ``offload train --compare`` times the same
        step as its ``no offloading`` baseline: the two say how the machine's pace moved
        between the profile and the run (``Report.pace``)."""
        with self.batch() as (args, kwargs):
            self.sync()
            t0 = time.perf_counter()
            with self.spec.autocasting():
                loss = self.spec.loss(self.spec.module(*args, **kwargs))
            loss.backward()
            self.sync()
            elapsed = time.perf_counter() - t0
        del loss
        self.zero_grads()
        return elapsed

    def base_parts(self) -> dict[str, int]:
        m = self.spec.module
        parts = {"parameters": distinct_bytes(m.parameters()), "buffers": distinct_bytes(m.buffers()),
                 "gradients": distinct_bytes(p.grad for p in self.params if p.grad is not None),
                 "batch": distinct_bytes(self.spec.tensors())}
        if self.optimizer is not None:
            parts["optimizer"] = distinct_bytes(v for st in self.optimizer.state.values() for v in st.values()
                                               if isinstance(v, torch.Tensor) and v.dim() > 0)
        return parts

    def memory_pass(self) -> MemoryPass:
        """One step read at every stage boundary."""
        L = self.L
        meter = make_meter(self.device)
        readings: list[tuple[int, int]] = []
        persistent = persistent_tensors(self.spec.module, self.optimizer, self.device)
        tracker = self.tracker(persistent)  # constant memory, counted in M0: never a unit
        peak_ops: list[int] = []

        def read() -> None:
            readings.append(meter.boundary())
            peak_ops.append(getattr(meter, "interval_peak_op", -1) - start)
        listener = _Recording(L, read, tracker, self.device)

        recasts: list[dict[tuple[int, torch.dtype], casts.Recast]] = [{} for _ in range(L)]
        made = _CastsMade(tracker)

        def pack(t: torch.Tensor) -> Any:
            tracker.saw(t)
            listener.saved()
            packed = casts.pack(t)
            if isinstance(packed, casts.Recast):  # one cast per weight and dtype in a stage, however many views of it are saved
                recasts[tracker.stage - 1].setdefault((id(packed.parameter), packed.dtype), packed)
            return packed

        with meter:
            meter.track(persistent)
            meter.ignore(self.spec.tensors())  # the example the steps' batches are copied from
            with self.batch() as (args, kwargs):
                tracker.exclude(tensors_in((args, kwargs)))
                meter.track(tensors_in((args, kwargs)))
                meter.boundary()
                m0, workspace = meter.live, meter.untracked
                start = getattr(meter, "ops", 0)  # ops before the forward's first
                lives: list[int] = []
                if isinstance(meter, CpuMeter):
                    meter.trace = lives
                def unpack(packed: Any) -> torch.Tensor:
                    t = casts.unpack(packed)
                    # the window of B_k: L + (L - k) readings so far (before the turn, the loss's backward: F_L's)
                    tracker.read(t, min(L, 2 * L - len(readings)))
                    return t
                try:
                    with made, listener.writes:
                        loss = self.forward(args, kwargs, listener, pack, unpack)
                finally:
                    listener.close()
                dropped = tracker.dropped_saves(L)
                loss.backward()  # the hooks on the boundaries' values and on the turn hold the listener
                readings.append(meter.boundary())  # B_1
                del loss
        meter.close()
        self.zero_grads()
        if len(readings) != 2 * L:
            raise RuntimeError(f"expected {2 * L} stage boundaries in a step, saw {len(readings)}")
        saved, need = tracker.units(L)
        exact = isinstance(meter, CpuMeter)
        starts = [m0] + [live for _, live in readings[:L - 1]]
        bwd_starts = [readings[2 * L - i - 1][1] for i in range(1, L + 1)]  # B_L starts at the turn
        return MemoryPass(m0, [p for p, _ in readings[:L]], [p for p, _ in readings[L:]][::-1], saved, need,
                          peak_ops[:L] if exact else None, lives if exact else None, starts, bwd_starts,
                          listener.inputs, listener.own, listener.new_held, listener.output_rebuilt, listener.why,
                          workspace,
                          [list(r.values()) for r in recasts], made.shared, made.twice, tracker.shared_saves(L),
                          dropped, tracker.storage_counts(L), tracker.save_counts(L), listener.lets_go,
                          listener.prev)

    def recast_seconds(self, recasts: list[casts.Recast]) -> float:
        """What making a stage's weight casts again costs its backward: the casts, timed."""
        return timed(lambda: [r.tensor() for r in recasts], self.sync)[1] if recasts else 0.0

    def timing_pass(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """(forward seconds of each stage, backward seconds of each stage, and the host's seconds
        to issue each: forward, backward) of one step."""
        clock = Clock(self.device)
        persistent = persistent_tensors(self.spec.module, self.optimizer, self.device)
        with self.batch() as (args, kwargs):
            # the executor's own work on every saved tensor, whatever it moves: which unit it is in
            tracker = self.tracker(persistent + tensors_in((args, kwargs)))
            listener = Boundaries(self.L, clock.mark, tracker)

            def pack(t: torch.Tensor) -> Any:
                tracker.saw(t)
                return casts.pack(t)
            self.sync()
            clock.mark()
            # behind torch.compiler.disable as the executor's hooks are (``forward``): its cost on
            # every saved tensor, both ways, is the executor's too (about 1 us each on the development CPU)
            loss = self.forward(args, kwargs, listener, pack)
            loss.backward()
            clock.mark()
        times, host = clock.intervals(), clock.host_intervals()  # F_1..F_L, then B_L..B_1
        del loss
        self.zero_grads()
        return times[:self.L], times[self.L:][::-1], host[:self.L], host[self.L:][::-1]


BOUNDARY_DEATH = 0.5  # a storage that dies after a boundary, before the next op: its death's place


class _Holding(StageListener, TorchDispatchMode):
    """The holding pass: counts the ops, records at which op each saved storage dies, and reads
    the meter (the mode outside this one) after every op: the most bytes live beyond ``m0``
    and the storages of earlier units during each forward op (``transient``), with the stage's
    checkpoint held through it as the executor holds it when a run starts there (a stage
    within a run is booked a little high when its input would die before its end), and for
    the stages in ``keeping`` what their kept ops output held through them, as the executor
    runs a stage re-run in part (``offload.core.selective.KeptOutputs``)."""

    def __init__(self, L: int, tracker: UnitTracker, meter: Any, device: torch.device,
                 keeping: dict[int, str] | None = None) -> None:
        TorchDispatchMode.__init__(self)
        self.L, self.tracker, self.meter, self.device = L, tracker, meter, device
        self.checkpoint: StageRecorder | None = None  # of the running stage (what it holds, nothing else)
        self.keeping, self.kept = keeping or {}, None  # stage -> option; the running stage's KeptOutputs
        self.ops = 0
        self.past_boundary = False  # a forward boundary came after the last op counted
        self.m0 = 0  # bytes live as the forward starts
        self.first_op = [0] * (L + 2)  # per stage, its first op
        self.storages: list[Saved] = []
        self.death: list[float] = []  # per storage, the op at which it died (inf: alive at the end)
        self.read_later: list[int] = []  # per storage, the first stage after the next whose forward reads it (0: none)
        self.number: dict[int, int] = {}  # a live storage's key -> its place in ``storages``
        self.transient = [0] * (L + 1)  # per F_j
        self.unit_alive = [0] * (L + 1)  # per unit, bytes of its storages alive now
        self.earlier = 0  # bytes of storages of units before the running stage alive now
        self._finalizers: list[weakref.finalize] = []

    def forward_start(self) -> None:
        self._hold(1, None)

    def stage_output(self, k: int, x: torch.Tensor, opening: bool) -> None:
        self._hold(k + 1, x if k + 1 < self.L else None, opening)

    def _hold(self, k: int, x: torch.Tensor | None, opening: bool = False) -> None:
        self.stop_recording()
        self.stop_keeping()  # the kept outputs are let go: the model counts them from F(k) on
        self.checkpoint = (StageRecorder(k, x, self.device, self.tracker.excluded, opening=opening,
                                         code=self.encloses(k))
                           if k < self.L else None)
        if k in self.keeping:
            self.kept = KeptOutputs(k, self.keeping[k])
            self.kept.__enter__()

    def forward_boundary(self, k: int) -> None:
        if k < self.L:
            self.earlier += self.unit_alive[k]
            self.tracker.stage = k + 1
            self.first_op[k + 1] = self.ops + 1
            self.past_boundary = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is UNCOUNTED:
            return func(*args, **(kwargs or {}))
        self.ops += 1
        self.past_boundary = False
        for t in tree_flatten((args, kwargs))[0]:
            if self.number and isinstance(t, torch.Tensor) and plain(t):
                n = self.number.get(storage_key(t))
                if n is not None and not self.read_later[n] and self.tracker.stage >= self.storages[n].unit + 2:
                    self.read_later[n] = self.tracker.stage
        out = func(*args, **(kwargs or {}))
        j = self.tracker.stage
        self.transient[j] = max(self.transient[j], self.meter.live - self.m0 - self.earlier)
        return out

    def _died(self, n: int, key: int) -> None:
        # between a boundary and the next stage's first op (the caller's ``x = block(x)`` drops
        # the old value after the block's hooks): half an op on, so that it counts as alive into
        # that stage, as the meter counts it, whose reading at the boundary starts the stage's
        self.death[n] = self.ops + (BOUNDARY_DEATH if self.past_boundary else 0)
        if self.number.get(key) == n:
            del self.number[key]
        saved = self.storages[n]
        self.unit_alive[saved.unit] -= saved.nbytes
        if saved.unit < self.tracker.stage:
            self.earlier -= saved.nbytes

    def pack(self, t: torch.Tensor) -> torch.Tensor | None:
        if self.checkpoint is not None:  # its recorder records what its own code saves with
            self.checkpoint.saved()
        saved = self.tracker.saw(t)
        if saved is None and self.tracker.stays(t):  # autograd keeps it, as in every step (core.units)
            return casts.kept(t)
        if saved is not None and saved.new:
            self.unit_alive[saved.unit] += saved.nbytes
            self.death.append(float("inf"))
            self.read_later.append(0)
            self.number[saved.key] = len(self.storages)
            self._finalizers.append(weakref.finalize(t.untyped_storage(), self._died, len(self.storages), saved.key))
            self.storages.append(saved)
        return None  # autograd keeps no reference to a unit's storage: only the model's own code can

    def stop_keeping(self) -> None:
        if self.kept is not None:
            self.kept.__exit__(None, None, None)
            self.kept = None

    def stop_recording(self) -> None:
        """The running stage has ended (or the forward failed in it)."""
        if self.checkpoint is not None:
            self.checkpoint.close()
            self.checkpoint = None

    def close(self) -> None:
        self._hold(self.L, None)
        for f in self._finalizers:
            f.detach()


@dataclass
class Holding:
    """Per stage, from the holding pass (``holding_pass``)."""

    held_bytes: int
    held_until: int
    carry_bytes: int
    recomputed_fwd_peak_bytes: int  # F_i's transient when autograd keeps none of U_i
    carried: set[int] = field(default_factory=set)  # indices in U_i of the storages in carry_bytes ...
    held: set[int] = field(default_factory=set)  # ... and in held_bytes
    held_read_at: int = 0  # the first forward after F(i+1) that reads a storage in held_bytes (0: none does)
    early: dict[int, int] = field(default_factory=dict)  # of ``carried``, dying as F(i+1) starts (bytes) ...
    late: dict[int, int] = field(default_factory=dict)  # ... not held, dying only as F(i+2) starts ...
    held_late: dict[int, int] = field(default_factory=dict)  # ... of ``held``, only as F(held_until+1) starts (bytes)
    saved_bytes: int = 0  # U_i as this pass saw it: the memory pass's, one update later, unless draws or weights set it


def holding_pass(runner: StepRunner, peak_ops: list[int] | None, peaks: list[int],
                 starts: list[int], keeping: dict[int, str] | None = None,
                 op_lives: list[int] | None = None) -> list[Holding]:
    """Per stage, the storages of its unit that the model's own code (a local of its forward,
    an argument of a call still running, a cache) keeps alive at the peak of ``F(i+2)`` or
    later, and those alive when ``F(i+1)`` runs its first op (what a recomputation, which
    keeps nothing of the unit, still finds there), when autograd keeps none of them; and the
    transient of each ``F_i`` then (its peak less ``M0`` and the earlier units' storages still
    alive, which the model counts as their held or carried parts, read after every op).  One forward in
    which the saved tensors are dropped as they are saved (the graph can run no backward),
    with ops counted as in the memory pass: ``peak_ops[j]`` is the op at which ``F(j+1)``
    peaked there, ``peaks[j]`` and ``starts[j]`` its peak and the bytes live as it started
    (exact meter, CPU).  A storage that dies as ``F(j+1)`` starts, before its first op (a
    local of an outer forward: ``x = block(x)`` drops the old ``x`` after the block's last
    hook), is held through it if it would raise the stage's peak there: when the stage
    started within its bytes of its peak; one that dies within ``F(j+1)`` before its peak
    (a U-Net's skip features, read by the concatenation that starts an up block) likewise, if
    an op before its death came within the bytes of such storages of the peak (``op_lives``:
    the memory pass's bytes live at each op).  A carried storage, not held, that dies as
    ``F(i+2)`` starts is *late* (``late``), and so is a held one that dies as
    ``F(held_until+1)`` starts (``held_late``): the reading that ends the op before holds it, so
    that a schedule which keeps none of ``U_i`` there still finds it in that op's first
    reading.  Without op counts (CUDA's meter gives none), a
    storage alive at a stage's first op counts as held through the stage: a little
    conservative.  ``keeping``: stages (each with an in-stage option) whose kept ops' outputs
    are held through their forward (their transient is then the option's).  The pass also
    notes which stages' ops read each saved storage, so that a held part's next reader after
    ``F(i+1)`` is known (``held_read_at``: until then a schedule may take it off the device)."""
    persistent = persistent_tensors(runner.spec.module, runner.optimizer, runner.device)
    meter = make_meter(runner.device)
    holding = _Holding(runner.L, runner.tracker(persistent), meter, runner.device, keeping)
    with meter:
        meter.track(persistent)
        with runner.batch() as (args, kwargs):
            holding.tracker.exclude(tensors_in((args, kwargs)))
            meter.track(tensors_in((args, kwargs)))
            holding.m0 = meter.live
            with holding:
                try:
                    loss = runner.forward(args, kwargs, holding, holding.pack)
                finally:
                    holding.stop_keeping()
                    holding.stop_recording()
                end = holding.ops  # the forward and the loss are done (an autocast cache is emptied here)
            del loss
    meter.close()
    holding.close()
    at = list(peak_ops if peak_ops is not None else holding.first_op[1:runner.L + 1])
    at[-1] = min(at[-1], end)  # F_L's peak may come in the loss's backward, which this pass does not run
    at_start: dict[int, int] = {}  # F_j -> bytes of the storages that die as it starts
    for saved, death in zip(holding.storages, holding.death):
        for j in range(saved.unit + 2, runner.L + 1):
            if holding.first_op[j] - 1 <= death < at[j - 1]:
                at_start[j] = at_start.get(j, 0) + saved.nbytes
    matters = {j for j, b in at_start.items() if peak_ops is None or starts[j - 1] + b > peaks[j - 1]}
    inside: dict[int, list[tuple[float, int]]] = {}  # F_j -> (death, bytes) of earlier units' storages dying in it
    for saved, death in zip(holding.storages, holding.death):
        for j in range(saved.unit + 2, runner.L + 1):
            if holding.first_op[j] <= death < at[j - 1]:
                inside.setdefault(j, []).append((death, saved.nbytes))
    if op_lives is not None:  # what dies inside F_j before its peak is held through it if an op before its death came close
        for j, dying in inside.items():
            room = peaks[j - 1] - sum(b for _, b in dying)
            lo = holding.first_op[j] - 1
            for death, _ in dying:
                if max(op_lives[lo:int(death)], default=0) > room:
                    matters.add(j)
                    at_start.setdefault(j, 0)
    out = [Holding(0, 0, 0, 0) for _ in range(runner.L + 1)]
    for saved, death in zip(holding.storages, holding.death):
        i, h = saved.unit, out[saved.unit]
        if i < runner.L and death > holding.first_op[i + 1] - 1:  # alive into F(i+1): its peak may move
            h.carry_bytes += saved.nbytes  # there once the unit is not saved, so at any of its ops
            h.carried.add(saved.index)
            if death == holding.first_op[i + 1] - 1 + BOUNDARY_DEATH:  # F(i)'s last reading holds it: F(i+1)'s first
                h.early[saved.index] = saved.nbytes
        alive = [j for j in range(i + 2, runner.L + 1)
                 if death >= at[j - 1] or (j in matters and death >= holding.first_op[j] - 1)]
        if alive:
            h.held_bytes += saved.nbytes
            h.held.add(saved.index)
            h.held_until = max(h.held_until, max(alive))
        elif i + 2 <= runner.L and death == holding.first_op[i + 2] - 1 + BOUNDARY_DEATH:
            h.late[saved.index] = saved.nbytes  # F(i+1)'s last reading holds it: F(i+2)'s first
    for saved, death in zip(holding.storages, holding.death):  # the same for a held part, once held_until is known
        h = out[saved.unit]
        if saved.index in h.held and h.held_until < runner.L \
                and death == holding.first_op[h.held_until + 1] - 1 + BOUNDARY_DEATH:
            h.held_late[saved.index] = saved.nbytes
    for saved, later in zip(holding.storages, holding.read_later):  # after F(i+1), the first forward reading the part
        h = out[saved.unit]
        if later and saved.index in h.held:
            h.held_read_at = min(h.held_read_at or later, later)
    units, _ = holding.tracker.units(runner.L)
    for j in range(1, runner.L + 1):
        out[j].recomputed_fwd_peak_bytes = max(0, holding.transient[j])
        out[j].saved_bytes = units[j - 1]
    return out[1:]


def _same_units(first: list[int], second: list[int]) -> None:
    """Refuse a model whose units are not the same bytes in two steps of one batch (``first``,
    ``second``, the weights updated in between): what a stage saves follows its random draws
    or its weights (a Switch Transformer routes each token to an expert and drops those over
    an expert's capacity, so each expert saves as many rows as it got), and a schedule moves
    and budgets each unit's profiled bytes."""
    varied = [(k, a, b) for k, (a, b) in enumerate(zip(first, second), 1) if a != b]
    if varied:
        k, a, b = varied[0]
        raise ModelError(f"what the model saves for the backward changes from one step to the next on the same batch: "
                         f"stage {k} saved {a} B in one step and {b} B in the next ({len(varied)} stage(s) differ); "
                         "its shapes follow its random draws or its weights (a mixture of experts that drops the "
                         "tokens over an expert's capacity, say), and a schedule is made for fixed bytes",
                         "units whose sizes follow the data are not supported yet (docs/executor.md); an expert "
                         "capacity no batch reaches keeps them fixed (Switch Transformers: expert_capacity at least "
                         "the tokens of a batch)")


def _input_part(storages: set[int] | dict[int, int], own: dict[int, int]) -> int:
    """Of ``storages`` (indices in a unit), the bytes of the stage's input's (``own``: its
    checkpoint's storages in its own unit, index -> bytes)."""
    return sum(b for n, b in own.items() if n in storages)


def _prev_parts(mem: MemoryPass, held: list[Holding], i: int) -> tuple[int, int]:
    """Of stage ``i + 1``'s checkpoint, the bytes of the unit before's storages, and of those the
    ones its held part counts (``input_prev_bytes``, ``input_prev_held_bytes``)."""
    prev = mem.prev[i] if mem.prev else {}
    return sum(prev.values()), _input_part(held[i - 1].held, prev) if i else 0


def spread(values: list[float]) -> float:
    """(max - min) / median: how much the repeats disagree."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else 0.0


def unmetered_units(runner: StepRunner) -> list[int]:
    """Per stage, the bytes of its unit in one step run with no meter: on the CPU the memory
    passes read each op under a dispatch mode (``CpuMeter``), under which ``torch.compile``
    runs the model uncompiled, so a compiled model's units must be seen without one."""
    tracker = runner.tracker(persistent_tensors(runner.spec.module, runner.optimizer, runner.device))

    def pack(t: torch.Tensor) -> Any:
        tracker.saw(t)
        return casts.pack(t)
    with runner.batch() as (args, kwargs):
        tracker.exclude(tensors_in((args, kwargs)))
        loss = runner.forward(args, kwargs, Boundaries(runner.L, lambda: None, tracker), pack)
        loss.backward()
        del loss
    runner.zero_grads()
    return tracker.units(runner.L)[0]


def _same_when_compiled(metered: list[int], compiled: list[int]) -> None:
    """Refuse a chain whose units, read under the CPU's meter (the model run uncompiled), are not
    the compiled model's: its training, compiled, would be refused at its first step (a
    ResNet's BatchNorm saves its running statistics themselves uncompiled, and copies of them
    compiled: 512 B more in its first block's unit)."""
    varied = [(k, a, b) for k, (a, b) in enumerate(zip(metered, compiled), 1) if a != b]
    if varied:
        k, a, b = varied[0]
        raise ModelError(f"on the CPU this profile reads memory under a dispatch mode, which runs a torch.compile'd "
                         f"model uncompiled, and the compiled model saves other tensors for the backward: stage {k} "
                         f"saves {b} B compiled and {a} B uncompiled ({len(varied)} stage(s) differ); a chain of the "
                         "uncompiled model's units would be refused when it trains compiled",
                         "profile it as one compiled graph (--whole-graph, metered as compiled on the CPU too), or "
                         "uncompiled (no --compile), or on a GPU (whose memory is read from the allocator)")


def measure(runner: StepRunner, repeats: int, warmup: int, tick: Callable[[str], None] = lambda _: None) -> Measurement:
    """Warm up, take the memory pass, then ``repeats`` timing passes (``tick(phase)`` as each ends)."""
    update_s = runner.warmup(warmup)
    tick("warm-up")
    mem = runner.memory_pass()
    if mem.casts_twice and runner.staging.uncache_casts:  # a second cast would round its gradient otherwise
        runner.staging.uncache_casts = False
        mem = runner.memory_pass()
    if mem.shared_casts and runner.staging.clear_casts:  # the same
        runner.staging.clear_casts = False
        mem = runner.memory_pass()
    if any(mem.shared_saves) or any(mem.dropped_saves):  # they stay, in no unit (core.units)
        runner.staying = {k: staying_saves(a, b) for k, (a, b) in enumerate(zip(mem.shared_saves, mem.dropped_saves), 1)
                          if a or b}
        mem = replace(runner.memory_pass(), shared_saves=mem.shared_saves, dropped_saves=mem.dropped_saves)
    if runner.device.type == "cuda":  # the gradient check trains under deterministic kernels: budget for both
        with deterministic_kernels(runner.device):
            runner.warmup(1)  # the workspaces they make on first use exist before the pass reads
            mem = mem.widened(runner.memory_pass())
    m0, peak_f, peak_b, saved, need = mem.m0, mem.fwd_peaks, mem.bwd_peaks, mem.saved, mem.need
    runner.warmup(1)  # the weights updated once more: units whose bytes follow them (routing) differ next
    held = holding_pass(runner, mem.peak_ops, peak_f, mem.starts, op_lives=mem.op_lives)
    _same_units(saved, [h.saved_bytes for h in held])
    if runner.device.type == "cpu" and compiled(runner.spec.module):  # the meter ran it eager: the units
        _same_when_compiled(saved, unmetered_units(runner))  # must be the compiled ones
    tick("memory pass")
    times, plain = [], []
    for _ in range(repeats):  # each timed step beside a plain one: both see the machine at one pace
        times.append(runner.timing_pass())
        plain.append(runner.plain_step())
        tick("timed steps")
    recast_s = [runner.recast_seconds(r) for r in mem.casts]
    stages = []
    resident = 0
    why_not = list(mem.rerun)  # per stage, why it cannot be re-run (None: it can)
    for i in range(runner.L):
        fwd_peak = peak_f[i] - m0 - resident
        # the model's code may drop the stage's input (or a value its re-run reads) inside it,
        # which a run's checkpoint holds through its forward: then F_i recomputed holds up to
        # its input_bytes above its own peak, as measured (elsewhere the two passes may differ
        # by an allocator's rounding on a GPU: no more than the peak)
        above = mem.inputs[i][0] if mem.lets_go[i] else 0
        if why_not[i] is None and held[i].recomputed_fwd_peak_bytes > fwd_peak + above:
            why_not[i] = (f"stage {i + 1} cannot be re-run: the model's code lets go of its input inside it, and held "
                          f"as the re-run's checkpoint through its forward, it would take "
                          f"{format_bytes(held[i].recomputed_fwd_peak_bytes - fwd_peak)} above the stage's peak, more "
                          "than its input's bytes")
        # below the units where part of U_i was freed before B_i began: the backward of a value
        # F_i made and later stages read beside its output (SpeechT5's relative position
        # bias, read by every encoder layer) runs once their backwards have given it its
        # gradient, before B_i; the model holds U_i whole until B_i, above what was measured
        bwd_peak = max(0, peak_b[i] - m0 - resident - saved[i])
        bwd_start = min(bwd_peak, max(0, mem.bwd_starts[i] - m0 - resident - saved[i]))
        fwd_start = min(fwd_peak, max(0, mem.starts[i] - m0 - resident))
        resident += saved[i]
        # what dies as F(i+1) starts counts in its first reading only, unless a run's checkpoint holds it
        early = sum(b for n, b in held[i].early.items() if n not in mem.own[i])
        stages.append(StageMeasurement(statistics.median(t[0][i] for t in times), statistics.median(t[1][i] for t in times),
                                       saved[i], fwd_peak, bwd_peak, need[i], held[i].held_bytes,
                                       held[i].held_until, held[i].carry_bytes - early, mem.inputs[i][0], why_not[i] is None,
                                       bwd_start, min(fwd_peak + above, held[i].recomputed_fwd_peak_bytes),
                                       _input_part(held[i].carried, mem.own[i]), _input_part(held[i].held, mem.own[i]),
                                       statistics.median(t[2][i] for t in times),
                                       statistics.median(t[3][i] for t in times),
                                       sum(r.nbytes for r in mem.casts[i]), recast_s[i], mem.new_held[i],
                                       mem.output_rebuilt[i], mem.inputs[i][1],
                                       mem.shared_saves[i] if mem.shared_saves else (),
                                       mem.dropped_saves[i] if mem.dropped_saves else (),
                                       tuple(sorted(held[i].held)) if held[i].held_read_at else (),
                                       held[i].held_read_at, mem.storages[i] if mem.storages else 0,
                                       mem.saves[i] if mem.saves else 0, fwd_start,
                                       sum(held[i].late.values()), _input_part(held[i].late, mem.own[i]),
                                       sum(held[i].held_late.values()), _input_part(held[i].held_late, mem.own[i]),
                                       *_prev_parts(mem, held, i), early))
    step = [sum(f) + sum(b) for f, b, *_ in times]
    fixed = [why for why, a in zip(why_not[:-1], saved) if why is not None and a > 0]
    notes = [f"{len(fixed)} of {runner.L - 1} stages cannot be recomputed (the solver keeps or offloads them); "
             f"first: {fixed[0]}"] if fixed else []
    return Measurement(stages, m0, runner.base_parts(), step, update_s, notes, mem.workspace,
                       runner.staging.clear_casts, runner.staging.uncache_casts, plain)
