"""Applying a schedule during a real training step (docs/executor.md).

``OffloadRuntime`` runs one ``_Step`` per forward of the user's module: a stage listener
plus a pair of ``saved_tensors_hooks``.

* pack: every tensor saved for backward is attributed, by storage, to the unit of the first
  stage that saves it (``offload.core.units``: the profiler's rule, so units match the
  chain), numbered within it in first-save order (the chain's ``EncodedTensor.index``).
  Parameters and buffers (recognized at every forward, never from a snapshot), the
  forward's inputs and tensors a copy engine cannot move are never touched.  A tensor of a
  kept unit is returned as is; one of an offloaded or encoded unit is replaced by a small
  handle, and the step holds the storage itself, or the blob its encoder made of it (then
  the raw storage is freed as soon as the forward drops it: that is the encoding's saving);
* forward boundary ``k < L``: D2H of ``Uk``'s storages into host slots, then the releases due
  at ``k``: wait for those D2H copies, drop the step's reference (the storage is freed, the
  schedule's whole point); a unit that restores its held part also takes the storages the
  model's own code still holds off the device (``EVICT``: resized to nothing in place) and,
  before the forward of its restore point, gives them their memory back and copies their
  bytes in (``RESTORE``), which the forward that reads them next waits for (``RESTORED``);
* backward boundary ``L`` (the backward starts; the loss was the end of ``FL``): the releases
  due at ``L``; then at every backward boundary ``k``: free the prefetched ``U(k+1)``, issue
  the prefetches whose point is ``k`` into fresh device buffers, wait for the units needed
  from ``k``;
* unpack: the handle becomes a view of the prefetched buffer with the saved tensor's dtype,
  size, stride and offset, bit-identical to what was saved; an encoded storage is decoded
  once, by its first reader.  The step drops its buffer when the last saved reference is
  read, as autograd frees a saved tensor once its node has run.

Recomputation (docs/executor.md, "Recomputation"): a recomputed stage's top-level module
calls are recorded as it runs (``offload.core.rerun``); a tensor of its unit is packed as a
handle and the step keeps nothing of it, so the storage dies when the forward's code drops
it.  The input of a run's first stage (its checkpoint) is held.  At the backward boundary
of the run's op, after the prefetches are issued and before the waits, the run's stages
are replayed one after another from the checkpoint; each storage the replay saves becomes
the buffer of the handle with the same place in the stage's saves.  A stage re-run in part
(its in-stage option) also records, while its forward runs, what its kept ops output
(``offload.core.selective.KeptOutputs``), holds it until the replay and hands it back
there instead of running those ops again.  A run of one stage that offloads its checkpoint
(docs/executor.md, "Offloaded checkpoints") takes the input and the kept outputs apart into
their storages (``_Parts``) as the stage's forward ends, copies those like a unit's, drops
them at the release, fetches them into fresh buffers and, once the rebuild has waited for
that copy, puts the tensors together again as views of the buffers.

A handle points at its own step, so a step's backward may run after later forwards have
started; but a forward while an earlier step's graph is alive and its backward unfinished
is refused (the schedule covers one forward and backward at a time), and so is a second
backward through one forward (``retain_graph``: what the first read is gone).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from offload.core import casts
from offload.core.devices import ModuleTensors
from offload.core.encoders import ENCODERS, Encoder, flat_storage, usable_on
from offload.core.places import Place, at, bytes_of, place_of
from offload.core.rerun import NotRerunnable, StageProgram, StageRecorder
from offload.core.selective import KeptOutputs
from offload.core.staging import StageListener, Staging
from offload.core.units import UnitTracker, storage_key
from offload.errors import ChainMismatch
from offload.models.spec import tensors_in
from offload.step.actions import Recompute
from offload.step.events import CLOSING, D2H, EVICT, FREE, H2D, RECOMPUTE, RELEASE, RESTORE, RESTORED, WAIT, Event

from .arena import HostArena
from .backends import Copy, CpuEagerBackend, CudaBackend
from .plan import StepPlan


@dataclass
class _Stored:
    """One device storage of an offloaded or encoded unit, through its life in one step."""

    unit: int
    device: torch.Tensor | None  # the whole storage as bytes (or its blob), until released
    nbytes: int
    slot_index: int = -1
    slot: torch.Tensor | None = None
    d2h: Copy | None = None
    h2d: Copy | None = None
    buffer: torch.Tensor | None = None  # readable bytes: prefetched, or resident when kept encoded
    model_storage: torch.Tensor | None = None  # of a held part the model's code holds: from the release to the restore
    restore: Copy | None = None  # its H2D copy back
    codec: tuple[Encoder, torch.dtype, int] | None = None  # encoder, dtype and element count of the raw storage
    readers: int = 0  # saved references not yet read by the backward
    decoded: torch.Tensor | None = None  # the raw storage again, from its first reader to its last
    # per saved tensor's base (by id; a view shares its base's version counter): the base
    # watched, and until the release a ``detach()`` alias of it (sharing its counter too)
    watched: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)
    aliases: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)

    # Autograd's check that a saved tensor was not modified in place is off for what a
    # saved-tensors hook replaces; this does it.  Each saved reference's version counter
    # (shared by a tensor and its views, and by ``detach()``) is read at pack and again
    # whenever the step looks (another save of the storage, the release, unpack: a few
    # times per storage, not at every boundary, and each counter once however many views
    # of its base were saved).  Until the release a ``detach()`` alias is held (the step
    # holds the storage until then anyway), so an in-place write while the D2H may run is
    # always caught; after it, the saved tensor's base is watched while it lives.
    def saw(self, t: torch.Tensor) -> None:
        self.check_versions()  # a counter already watched is unchanged past here
        base = t if t._base is None else t._base
        known = self.watched.get(id(base))
        if known is not None and known[0]() is base:
            return
        self.watched[id(base)] = (weakref.ref(base), t._version)
        if self.device is not None and self.codec is None:
            self.aliases[id(base)] = (t.detach(), t._version)

    def read_once(self) -> None:
        """One saved reference read by the backward, or gone unread: after the last, the
        buffer goes, as autograd frees a saved tensor after the last node that reads it."""
        self.readers -= 1
        if self.readers == 0:
            self.buffer = self.decoded = None

    def check_versions(self) -> None:
        for alias, version in [*self.aliases.values(), *((ref(), v) for ref, v in self.watched.values())]:
            if alias is not None and alias._version != version:
                raise RuntimeError(f"a tensor saved for the backward (in U{self.unit}, {alias.dtype} {list(alias.shape)})"
                                   f" was modified by an in-place operation after it was saved (version "
                                   f"{alias._version}, saved at {version}): without offloading autograd refuses this "
                                   "too; with it the copy could hold either value")

    def drop_aliases(self) -> None:
        """Before the step lets go of the device storage: checked a last time, its aliases dropped."""
        self.check_versions()
        self.aliases = {}


class _Parts:
    """Tensors that are views of a few storages (a checkpoint: the stage's input and what its
    option keeps) taken apart: each distinct storage's bytes, and each tensor's place in them,
    to put them together again as views of other buffers holding the same bytes."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.storages: list[torch.Tensor] = []
        self.places: list[tuple[int, Place]] = []  # per tensor, its storage's index and its place there
        index: dict[int, int] = {}
        for t in tensors:
            n = index.setdefault(storage_key(t), len(self.storages))
            if n == len(self.storages):
                self.storages.append(bytes_of(t))
            self.places.append((n, place_of(t)))

    def rebuild(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        return [at(place, buffers[n]) for n, place in self.places]


class _Handle:
    """What the pack hook gives autograd for a saved tensor of a storage the step holds: the
    storage's id in its step (addresses are reused once a storage is released) and the
    tensor's layout in it.  One that dies unread counts as read (``_Stored.read_once``): its
    node was let go by the forward (the graph of an output the model discards), and the
    storage's buffer must not wait for it through the backward."""

    __slots__ = ("step", "sid", "place", "read")

    def __init__(self, step: "_Step", sid: int, t: torch.Tensor) -> None:
        self.step, self.sid, self.place = step, sid, place_of(t)
        self.read = False

    def __del__(self) -> None:
        if not self.read:
            self.step.stored[self.sid].read_once()


class _Step(StageListener):
    """The state of one forward and its backward."""

    def __init__(self, runtime: "OffloadRuntime", excluded: list[torch.Tensor],
                 filling: Callable[[], list[torch.Tensor]] | None = None) -> None:
        self.runtime, self.plan, self.backend = runtime, runtime.plan, runtime.backend
        self.tracker = UnitTracker(runtime.device, excluded, self.plan.staying, filling)
        self.sid: dict[int, int] = {}  # live storage key -> id of its held storage
        self.stored: list[_Stored] = []  # held storages (offloaded or encoded), by id
        self.units: dict[int, list[int]] = {i: [] for i in self.plan.offloaded | set(self.plan.encoders)
                                            | self.plan.recomputed}
        self.backward_started = self.finished = False
        self.recorder: StageRecorder | None = None  # of the recomputed stage running now
        self.programs: dict[int, StageProgram] = {}  # recomputed stage -> its replay
        self.ordinals: dict[int, list[int | None]] = {}  # recomputed stage -> per tensor it saved, its held storage
        self.checkpoints: dict[int, torch.Tensor] = {}  # first stage of a run -> its input, until the rebuild
        self.kept: dict[int, KeptOutputs] = {}  # stage re-run in part -> its kept ops' outputs, until the rebuild
        self.keeping: KeptOutputs | None = None  # entered while such a stage's forward runs
        self.moved: dict[int, tuple[_Parts, list[int]]] = {}  # stage -> its offloaded checkpoint's parts, held storages
        self.evicted: dict[int, list[int]] = {}  # unit restoring its held part -> the held storages' ids

    # ------------------------------------------------------------------ hooks (never traced by torch.compile)
    @torch.compiler.disable
    def pack(self, t: torch.Tensor) -> Any:
        saved = self.tracker.saw(t)
        sid = None
        if saved is not None:
            if saved.new:
                self._hold(saved.key, t, saved.unit, saved.index)
            sid = self.sid.get(saved.key)
        if self.recorder is not None:
            self.recorder.saved()
            self.ordinals[self.recorder.stage].append(sid)
        if sid is None:
            if saved is not None:  # a kept unit's storage (never a weight's cast: ``saw`` checked it)
                return casts.kept(t)
            # not a unit's: a weight's cast, kept or made again when read
            return casts.kept(t) if self.tracker.stage in self.plan.casts_kept else casts.pack(t)
        self.stored[sid].readers += 1
        self.stored[sid].saw(t)
        return _Handle(self, sid, t)

    def _hold(self, key: int, t: torch.Tensor, unit: int, index: int) -> None:
        """Take a new storage of ``unit`` into the step's hands if the schedule moves or encodes it."""
        self.sid.pop(key, None)  # an address reused by a new storage
        encoding = self.plan.encoders.get(unit, {}).get(index)
        if unit not in self.plan.offloaded and encoding is None and unit not in self.plan.recomputed:
            return
        sid = len(self.stored)
        self.sid[key] = sid
        self.units[unit].append(sid)
        if unit in self.plan.recomputed:  # nothing held: rebuilt before the backward reads it
            self.stored.append(_Stored(unit, None, t.untyped_storage().nbytes()))
            return
        if encoding is not None:
            flat = flat_storage(t)
            if flat.numel() * flat.element_size() != encoding.nbytes:
                # matched by position: another storage there (another device's kernels save
                # other tensors) must not get an encoder chosen for what was profiled
                raise ChainMismatch(f"storage #{index} of U{unit} is {flat.numel() * flat.element_size()} B; the chain's "
                                    f"{encoding.encoder} encoding was chosen for a {encoding.nbytes} B storage there",
                                    "profile the model on the device and setup it trains on, then solve again")
            codec = (ENCODERS[encoding.encoder], flat.dtype, flat.numel())
            held = codec[0].encode(flat)  # the raw storage dies with the forward's last use of it
            self.runtime.encoded_bytes += held.numel()
        else:
            codec = None
            held = bytes_of(t)
        offloaded = unit in self.plan.offloaded
        self.stored.append(_Stored(unit, held if offloaded else None, held.numel(), codec=codec,
                                   buffer=None if offloaded else held))
        if index in self.plan.evicted.get(unit, ()):
            self.evicted.setdefault(unit, []).append(sid)

    @staticmethod
    @torch.compiler.disable
    def unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return casts.unpack(packed)
        s = packed.step.stored[packed.sid]
        s.check_versions()
        if s.buffer is None:
            raise RuntimeError(f"U{s.unit} is read by the backward but was not prefetched or rebuilt: the schedule "
                               "and the model disagree on need_from")
        raw = s.buffer
        if s.codec is not None:
            if s.decoded is None:
                encoder, dtype, numel = s.codec
                s.decoded = encoder.decode(s.buffer, dtype, numel).view(torch.uint8)
            raw = s.decoded
        out = at(packed.place, raw)
        packed.read = True
        s.read_once()
        return out

    # -------------------------------------------------------------- recomputation
    def forward_start(self) -> None:
        self._record(1, None)

    def stage_output(self, k: int, x: torch.Tensor, opening: bool) -> None:
        self.stop_keeping()
        if self.recorder is not None:
            try:
                self.programs[k] = self.recorder.finish(x)
            except NotRerunnable as exc:
                raise ChainMismatch(f"{exc}; the schedule recomputes it", "profile the model again (the profiler "
                                    "marks such stages and the solver leaves them alone), then solve again") from None
            self.recorder = None
        if k + 1 < self.plan.L:
            self._record(k + 1, x, opening)

    def _record(self, k: int, x: torch.Tensor | None, opening: bool = False) -> None:
        """Stage ``k`` starts on input ``x``: record it if it is recomputed, hold ``x`` if a run
        starts there (``opening``: with a call that is starting, ``StageRecorder``)."""
        if k not in self.plan.recomputed:
            return
        self.recorder = StageRecorder(k, x, self.runtime.device, self.tracker.excluded, opening=opening,
                                      code=self.encloses(k))
        self.ordinals[k] = []
        if x is not None and k in self.plan.run_starts:
            self.checkpoints[k] = x.detach()
        if k in self.plan.in_part:
            self.keeping = self.kept[k] = KeptOutputs(k, self.plan.in_part[k])
            self.keeping.__enter__()

    def stop_keeping(self) -> None:
        """The stage whose kept ops' outputs were being recorded has ended (or the forward failed in it)."""
        if self.keeping is not None:
            self.keeping.__exit__(None, None, None)
            self.keeping = None

    def stop_recording(self) -> None:
        """The forward failed in a stage being recorded: its recorder lets go of the model."""
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def _offload_checkpoint(self, k: int) -> None:
        """Stage ``k``'s forward ended: its checkpoint (input, kept outputs) goes to the host."""
        kept = self.kept.get(k)
        parts = _Parts([self.checkpoints.pop(k)] + (kept.hand_over() if kept is not None else []))
        sids = list(range(len(self.stored), len(self.stored) + len(parts.storages)))
        self.stored += [_Stored(k, b, b.numel()) for b in parts.storages]
        parts.storages = []  # held by the step's storages until the release
        self.moved[k] = (parts, sids)
        self._offload(sids)

    def _checkpoint_back(self, k: int) -> None:
        """The rebuild of stage ``k`` waits for its checkpoint's copy, then reads it from the buffers."""
        parts, sids = self.moved.pop(k)
        self._wait(sids)
        x, *kept = parts.rebuild([self.stored[sid].buffer for sid in sids])
        for sid in sids:
            self.stored[sid].buffer = None  # the tensors hold the buffers now
        self.checkpoints[k] = x
        if kept:
            self.kept[k].take_back(kept)

    def _rebuild(self, run: Recompute) -> None:
        """Replay ``run`` from its checkpoint (docs/model.md, "Recomputation")."""
        x = self.checkpoints.pop(run.first, None)
        for j in run.stages:
            program = self.programs.pop(j)
            replayed = _Replay(self, j, run.stages)
            with self.kept.pop(j).serving() if run.option else contextlib.nullcontext():
                x = program.run(x, self.runtime.device, replayed.saved)
            replayed.check()
        del x

    # -------------------------------------------------------------- boundaries
    def forward_boundary(self, k: int) -> None:
        if k == self.plan.L:
            return  # the model returned; the loss still belongs to F_L (the turn is at the backward's start)
        self._check_unit(k)
        for e in self.plan.events.after_forward(k):
            self._run(e)
        self.runtime.read(f"F{k}")
        self.tracker.stage = k + 1

    def _check_unit(self, k: int) -> None:
        """Refuse a run whose stage ``k < L`` saves other bytes for the backward than it did when
        profiled (``UL`` is never moved, and the loss the training loop computes is outside
        the hooks): the model runs differently (compiled by another backend, under another
        autocast, on another device or batch, with data-dependent shapes), so the schedule's
        memory and the encoders' storages would be wrong."""
        got, expected = self.tracker.unit_bytes.get(k, 0), self.plan.unit_bytes[k]
        if abs(got - expected) > expected // 100 + 4096:
            raise ChainMismatch(f"stage {k} saved {got} B for the backward; when profiled it saved {expected} B: the "
                                "model does not run as it did when the chain was measured",
                                "profile it again as it is trained (same compile backend, autocast, device, batch "
                                "and checkpointing), then solve again")

    def _run(self, e: Event) -> None:
        """Do what event ``e`` of the step says (``ENCODE`` and ``DECODE`` happen in the pack and
        unpack hooks, as the saved tensors pass); a run's copies, release and wait act on its
        offloaded checkpoint."""
        if e.kind == RECOMPUTE:
            self._rebuild(e.run)
        elif e.run is not None and e.kind == D2H:
            self._offload_checkpoint(e.stage)
        elif e.run is not None and e.kind == WAIT:
            self._checkpoint_back(e.stage)
        elif e.kind == FREE:
            self._free(e.stage)
        elif e.kind in (EVICT, RESTORE, RESTORED):
            self._held_part(e.kind, self.evicted.get(e.stage, []))
        elif e.kind in (D2H, RELEASE, H2D, WAIT):
            sids = self.moved[e.stage][1] if e.run is not None else self.units[e.stage]
            if e.kind == D2H:
                self._offload(sids)
            elif e.kind == RELEASE:
                self._release(sids)
            elif e.kind == H2D:
                self._prefetch(sids)
            elif e.kind == WAIT:
                self._wait(sids)

    def _offload(self, sids: list[int]) -> None:
        """The D2H copies of these held storages into host slots, one batch."""
        arena, stored = self.runtime.arena, [self.stored[sid] for sid in sids]
        for s in stored:
            spare = s.codec[0].spare_bytes(s.nbytes) if s.codec is not None else 0
            s.slot_index, s.slot = arena.slot(s.nbytes, spare=spare)
        copies = self.backend.d2h_many([(s.device, s.slot, arena.guard(s.slot_index)) for s in stored])
        for s, copy in zip(stored, copies):
            s.d2h = copy
            self.runtime.d2h_bytes += s.nbytes

    def _release(self, sids: list[int]) -> None:
        """Wait for these storages' D2H copies, then drop the step's references to them (a held
        part's storage is kept aside for its eviction)."""
        self.backend.wait_many([self.stored[sid].d2h for sid in sids])
        for sid in sids:
            s = self.stored[sid]
            s.drop_aliases()
            self.backend.released(s.device)
            if sid in self.evicted.get(s.unit, ()):
                s.model_storage = s.device
            s.device = None
            s.d2h.keep.clear()

    def _held_part(self, kind: str, sids: list[int]) -> None:
        """A held part's storages: taken off the device (``EVICT``), given their memory back and
        copied in from their host slots (``RESTORE``), waited for (``RESTORED``: the step then lets
        them go, and they live as long as the model's code holds them)."""
        for sid in sids:
            s = self.stored[sid]
            if kind == EVICT:
                self.backend.evict(s.model_storage)
            elif kind == RESTORE:
                self.backend.restore(s.model_storage, s.nbytes)
                s.restore = self.backend.h2d(s.slot, s.model_storage, s.d2h)
                self.runtime.arena.set_guard(s.slot_index, s.restore)
                self.runtime.h2d_bytes += s.nbytes
            else:
                self.backend.wait(s.restore)
                s.model_storage = s.restore = None

    def _wait(self, sids: list[int]) -> None:
        """The compute stream waits for these storages' H2D copies."""
        self.backend.wait_many([self.stored[sid].h2d for sid in sids])

    def _prefetch(self, sids: list[int]) -> None:
        """The H2D copies of these held storages into fresh device buffers, one batch."""
        stored = [self.stored[sid] for sid in sids]
        for s in stored:
            s.buffer = self.backend.empty(s.nbytes)
        copies = self.backend.h2d_many([(s.slot, s.buffer, s.d2h) for s in stored])
        for s, copy in zip(stored, copies):
            s.h2d = copy
            self.runtime.arena.set_guard(s.slot_index, copy)
            self.runtime.h2d_bytes += s.nbytes

    def backward_boundary(self, k: int) -> None:
        L = self.plan.L
        if k == L:
            if self.backward_started and self.stored:
                raise RuntimeError("a second backward through one forward (retain_graph=True): the step released "
                                   "what it moved, encoded or recomputed as the first backward read it; run the "
                                   "forward again for each backward (or call torch.autograd.grad once for all)")
            self.backward_started = True
        self.runtime.read(f"F{L}" if k == L else f"B{k + 1}")  # F_L: the last stage and the loss
        opened = False
        for e in self.plan.events.before_backward(k):
            if not opened and e.kind not in CLOSING:  # the releases and frees belong to the op that ended
                self.runtime.read(None)
                opened = True
            self._run(e)
        if not opened:
            self.runtime.read(None)
        if k == 1:
            self.finished = True
            if self.runtime.meter is not None:  # B1 ends with the backward, before the optimizer step
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self.runtime.read("B1"))

    def _free(self, unit: int) -> None:
        for sid in self.units.get(unit, ()):
            self.stored[sid].buffer = self.stored[sid].decoded = None


class _Replay:
    """The saves of one recomputed stage's replay, matched to its forward's by their place; those
    of the run's own units become their buffers (a unit of another run is that run's to
    rebuild, at its own op, even when this stage reads it too)."""

    def __init__(self, step: _Step, stage: int, run: range) -> None:  # run: the run's stages
        self.step, self.stage, self.run, self.n = step, stage, run, 0
        self.sids = step.ordinals.pop(stage)

    def saved(self, t: torch.Tensor) -> None:
        sid = self.sids[self.n] if self.n < len(self.sids) else None
        self.n += 1
        if sid is not None:
            s = self.step.stored[sid]
            if s.unit in self.run and s.buffer is None:
                raw = bytes_of(t)
                if raw.numel() != s.nbytes:
                    raise RuntimeError(f"re-running stage {self.stage} saved a {raw.numel()} B storage where its "
                                       f"forward saved {s.nbytes} B: the stage does not run the same way twice")
                s.buffer = raw

    def check(self) -> None:
        if self.n != len(self.sids):
            raise RuntimeError(f"re-running stage {self.stage} saved {self.n} tensors for the backward where its "
                               f"forward saved {len(self.sids)}: the stage does not run the same way twice (data-dependent "
                               "control flow?); solve without recomputing it")


def _check_encoders(plan: StepPlan, backend: CpuEagerBackend | CudaBackend) -> None:
    """Refuse a schedule whose encoders this backend's steps may not run (``encoders.usable_on``)."""
    usable = usable_on(backend.gpu)
    for unit, tensors in sorted(plan.encoders.items()):
        for t in tensors.values():
            if t.encoder not in usable:
                raise ChainMismatch(f"U{unit} is stored with the {t.encoder} encoder, which reads its size back from the "
                                    "device: on a GPU every such read stalls the step's kernel launches",
                                    "profile the model on the GPU it trains on (the profiler offers no such encoder "
                                    "there), then solve again; or solve with --encodings none")


class OffloadRuntime:
    """A schedule applied to every forward of a staged module (and its backward)."""

    def __init__(self, staging: Staging, plan: StepPlan, backend: CpuEagerBackend | CudaBackend,
                 device: torch.device) -> None:
        if staging.L != plan.L:
            raise ValueError(f"the model has {staging.L} stages, the schedule's chain {plan.L}")
        self.staging, self.plan, self.backend, self.device = staging, plan, backend, device
        _check_encoders(plan, backend)
        self.arena = HostArena(plan.planned_bytes, pin=backend.pin)
        self.meter: Any = None  # set by ``reading``: read at every op's end into ``op_peaks``
        self.baseline: Callable[[], int] | None = None  # set by ``reading``: asked as each forward starts
        self.shift = 0  # its answer for the running step
        self.op_peaks: dict[str, int] = {}  # op name -> the most bytes live during it
        self.d2h_bytes = self.h2d_bytes = 0
        self.encoded_bytes = 0  # blobs made by the encoders, all steps
        self.steps = 0
        self._last: Callable[[], _Step | None] = lambda: None
        self.persistent = ModuleTensors(staging.module)  # never a unit's: excluded at every step

    @contextlib.contextmanager
    def reading(self, meter: Any, baseline: Callable[[], int] | None = None) -> Iterator[dict[str, int]]:
        """In this block, each op's peak is read from ``meter`` at its end: ``op_peaks``,
        restarted.  ``baseline``: asked as each forward starts, the bytes taken off every
        reading of that step (what the loop made since the block began and holds as the
        forward starts: its batch, the optimizer's state)."""
        self.meter, self.op_peaks, self.baseline, self.shift = meter, {}, baseline, 0
        try:
            yield self.op_peaks
        finally:
            self.meter = self.baseline = None

    def read(self, op: str | None) -> None:
        """The peak since the last reading, as the memory of ``op`` (``None``: just restart)."""
        if self.meter is not None:
            peak, _ = self.meter.boundary()
            if op is not None:
                self.op_peaks[op] = max(peak - self.shift, self.op_peaks.get(op, 0))

    @torch.compiler.disable(recursive=False)
    def forward(self, args: tuple, kwargs: dict) -> Any:
        """One forward of the staged module with the schedule applied (its backward follows).

        Under ``torch.compile`` this frame runs eagerly and the module's own frames compile,
        with a graph break at every stage boundary (``offload.core.staging``)."""
        step = self._new_step(args, kwargs)
        try:
            with self.staging.listening(step), torch.autograd.graph.saved_tensors_hooks(step.pack, _Step.unpack):
                return self.staging.module(*args, **kwargs)
        finally:
            step.stop_keeping()
            step.stop_recording()

    @torch.compiler.disable
    def _new_step(self, args: tuple, kwargs: dict) -> _Step:
        last = self._last()
        if last is not None and not last.finished and self.plan.L > 1:
            raise RuntimeError("a forward while the previous forward's backward has not finished: the schedule covers "
                               "one forward and its backward at a time; call backward() first (several micro-batches: "
                               "forward and backward each in turn), or evaluate under torch.no_grad()")
        if self.steps == 1:  # attributes the first call set, a cache it filled: persistent from here on
            self.persistent.scan()
        step = _Step(self, self.persistent.now() + tensors_in((args, kwargs)),
                     self.persistent.held if self.steps == 0 else None)
        self.read(None)  # what ran since the last backward (the optimizer step, data loading) is no op's
        if self.baseline is not None:
            self.shift = self.baseline()
        self._last = weakref.ref(step)  # alive as long as its autograd graph holds a handle or a boundary
        self.steps += 1
        self.arena.start_step()
        return step

    def synchronize(self) -> None:
        self.backend.synchronize()
