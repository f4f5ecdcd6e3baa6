"""Applying a schedule during a real training step (DESIGN section 6).

``OffloadRuntime`` is a stage listener plus a pair of ``saved_tensors_hooks``:

* pack: every tensor saved for backward is attributed, by storage, to the unit of the first
  stage that saves it (the profiler's rule, so units match the chain), and numbered within
  it in first-save order (the chain's ``EncodedTensor.index``).  Weights, buffers,
  gradients, optimizer state and the input batch are never touched.  A tensor of a kept unit is returned as
  is; one of an offloaded or encoded unit is replaced by a small handle, and the runtime
  holds the storage itself, or the blob its encoder made of it (then the raw storage is
  freed as soon as the forward drops it: that is the encoding's saving);
* forward boundary ``k``: D2H of ``Uk``'s storages into host slots, then the releases due
  at ``k``: wait for those D2H copies, drop the runtime's reference (the storage is freed,
  the schedule's whole point);
* backward boundary ``k``: free the prefetched ``U(k+1)``, issue the prefetches whose point
  is ``k`` into fresh device buffers, wait for the units needed from ``k``;
* unpack: the handle becomes a view of the prefetched buffer with the saved tensor's dtype,
  size, stride and offset, bit-identical to what was saved; an encoded storage is decoded
  once, by its first reader.  The runtime drops its buffer when the last saved reference
  is read, as autograd frees a saved tensor once its node has run: holding a unit's
  buffers to the end of its stage would keep more than the profiled step did.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from profiler.encoders import ENCODERS, Encoder, flat_storage
from profiler.measure import storage_key
from profiler.staged import StagedModel, StageListener, stage_boundary

from .arena import HostArena
from .backends import Copy, CpuEagerBackend, CudaBackend
from .plan import StepPlan


@dataclass
class _Stored:
    """One device storage of an offloaded unit, through its life in one step."""

    unit: int
    device: torch.Tensor | None  # the whole storage as bytes (or its blob), until released
    nbytes: int
    slot_index: int = -1
    slot: torch.Tensor | None = None
    d2h: Copy | None = None
    h2d: Copy | None = None
    buffer: torch.Tensor | None = None  # readable bytes: prefetched, or resident when kept encoded
    codec: tuple[Encoder, torch.dtype, int] | None = None  # encoder, dtype and element count of the raw storage
    readers: int = 0  # saved references not yet read by the backward
    decoded: torch.Tensor | None = None  # the raw storage again, from its first reader to its last


@dataclass(frozen=True)
class _Handle:
    sid: int  # the storage's id in this step (addresses are reused once a storage is released)
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class OffloadRuntime(StageListener):
    def __init__(self, staged: StagedModel, plan: StepPlan, backend: CpuEagerBackend | CudaBackend) -> None:
        if staged.L != plan.L:
            raise ValueError(f"the model has {staged.L} stages, the schedule's chain {plan.L}")
        self.staged, self.plan, self.backend = staged, plan, backend
        self.arena = HostArena(plan.planned_bytes, pin=backend.pin)
        # the staged module shares the user's parameters and buffers: never offloaded
        module = staged.module
        self.persistent = {storage_key(t) for t in [*module.parameters(), *module.buffers()]}
        self.batch: set[int] = set()  # storages of this step's inputs
        self.meter: Any = None  # when set (one step), read at every op's end: ``op_peaks``
        self.op_peaks: dict[str, int] = {}  # op name -> the most bytes live during it
        self.d2h_bytes = self.h2d_bytes = 0
        self.encoded_bytes = 0  # blobs made by the encoders, all steps
        self._reset()

    def _reset(self) -> None:
        self.stage = 1
        # storage key -> the storage, weakly: the storages numbered this step.  A key is an
        # address, which a new storage may take once a released or encoded storage has died
        self.seen: dict[int, weakref.ref] = {}
        self.sid: dict[int, int] = {}  # live storage key -> id of its held storage
        self.stored: list[_Stored] = []  # held storages (offloaded or encoded), by id
        self.count: dict[int, int] = {}  # unit -> storages numbered so far
        self.units: dict[int, list[int]] = {i: [] for i in self.plan.offloaded | set(self.plan.encoders)}

    # ------------------------------------------------------------------ hooks
    def pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t)
        if key in self.persistent or key in self.batch:
            return t
        storage = t.untyped_storage()
        known = self.seen.get(key)
        if known is not None and known() is not storage:  # the address of a storage that died
            del self.seen[key]
            self.sid.pop(key, None)
            known = None
        if known is None:
            self.seen[key] = weakref.ref(storage)
            index = self.count[self.stage] = self.count.get(self.stage, 0) + 1
            self._hold(key, t, self.stage, index - 1)
        sid = self.sid.get(key)
        if sid is None:
            return t
        self.stored[sid].readers += 1
        return _Handle(sid, t.dtype, t.size(), t.stride(), t.storage_offset())

    def _hold(self, key: int, t: torch.Tensor, unit: int, index: int) -> None:
        """Take a new storage of ``unit`` into the runtime's hands if the schedule moves or encodes it."""
        encoder = self.plan.encoders.get(unit, {}).get(index)
        if unit not in self.plan.offloaded and encoder is None:
            return
        sid = len(self.stored)
        if encoder is not None:
            flat = flat_storage(t)
            codec = (ENCODERS[encoder], flat.dtype, flat.numel())
            held = codec[0].encode(flat)  # the raw storage dies with the forward's last use of it
            self.encoded_bytes += held.numel()
        else:
            codec = None
            held = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        self.sid[key] = sid
        offloaded = unit in self.plan.offloaded
        self.stored.append(_Stored(unit, held if offloaded else None, held.numel(), codec=codec,
                                   buffer=None if offloaded else held))
        self.units[unit].append(sid)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        s = self.stored[packed.sid]
        if s.buffer is None:
            raise RuntimeError(f"U{s.unit} is read by the backward but was not prefetched: the schedule and the "
                               "model disagree on need_from")
        raw = s.buffer
        if s.codec is not None:
            if s.decoded is None:
                encoder, dtype, numel = s.codec
                s.decoded = encoder.decode(s.buffer, dtype, numel).view(torch.uint8)
            raw = s.decoded
        out = raw.view(packed.dtype).as_strided(packed.size, packed.stride, packed.offset)
        s.readers -= 1
        if s.readers == 0:  # the last saved reference is read: autograd would free it after this node
            s.buffer = s.decoded = None
        return out

    # -------------------------------------------------------------- boundaries
    def forward_boundary(self, k: int) -> None:
        if k in self.plan.offloaded:
            for sid in self.units[k]:
                s = self.stored[sid]
                varies = s.codec is not None and s.codec[0].name == "sparse"  # its size follows the zeros
                s.slot_index, s.slot = self.arena.slot(s.nbytes, spare=s.nbytes // 8 if varies else 0)
                s.d2h = self.backend.d2h(s.device, s.slot, self.arena.guard(s.slot_index))
                self.d2h_bytes += s.nbytes
        for i in self.plan.release_at.get(k, ()):
            for sid in self.units[i]:
                s = self.stored[sid]
                self.backend.wait(s.d2h)
                self.backend.released(s.device)
                s.device = None
                s.d2h.keep.clear()
        self._read(f"F{k}")
        self.stage = min(k + 1, self.plan.L)

    def backward_boundary(self, k: int) -> None:
        self._read(f"B{min(k + 1, self.plan.L)}")  # at the turn: the loss, counted with B_L
        self._free(k + 1)
        self._read(None)  # the frees belong to the op that ended, the prefetches to the next
        for i in self.plan.prefetch_at.get(k, ()):
            for sid in self.units[i]:
                s = self.stored[sid]
                s.buffer = self.backend.empty(s.nbytes)
                s.h2d = self.backend.h2d(s.slot, s.buffer, s.d2h)
                self.arena.set_guard(s.slot_index, s.h2d)
                self.h2d_bytes += s.nbytes
        for i in self.plan.wait_at.get(k, ()):
            for sid in self.units[i]:
                self.backend.wait(self.stored[sid].h2d)

    def _read(self, op: str | None) -> None:
        """The peak since the last reading, as the memory of ``op`` (``None``: just restart)."""
        if self.meter is not None:
            peak, _ = self.meter.boundary()
            if op is not None:
                self.op_peaks[op] = max(peak, self.op_peaks.get(op, 0))

    def _free(self, unit: int) -> None:
        for sid in self.units.get(unit, ()):
            self.stored[sid].buffer = self.stored[sid].decoded = None

    # -------------------------------------------------------------------- step
    def forward(self, *inputs: torch.Tensor) -> Any:
        """The model's forward with the output boundary (the turn, ``k = L``) appended.  The
        batch is the training loop's, alive through the step: never offloaded (as profiled)."""
        self.batch = {storage_key(t) for t in inputs}
        out = self.staged(*inputs)
        if isinstance(out, torch.Tensor):
            return stage_boundary(out, self.plan.L)
        raise TypeError("the executor needs a model whose output is one tensor")

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step: run the forward, the loss and ``backward()`` inside."""
        self._reset()
        self.arena.start_step()
        try:
            with self.staged.listening(self), torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._free(1)
            self.backend.synchronize()
            self._reset()
