"""Which unit each saved storage belongs to: one rule for the profiler and the executor.

Autograd saves tensors for the backward through ``saved_tensors_hooks``; the pack hook
sees each one.  The chain's unit ``Ui`` is the storages that stage ``i`` is the *first* to
save, deduplicated by storage (views of one storage are one thing to move), numbered in
first-save order (the chain's ``EncodedTensor.index``); a storage's ``need_from`` is the
*last* stage that saves it (the first backward to read it), or a later stage whose
backward's window is the first to read it (``UnitTracker.read``): a value a stage makes
beside its output and later stages read (SpeechT5's relative position bias, built after
its first layer's input) has its backward run once theirs have given it its gradient,
before the backward of the stage that made it.  The profiler sizes the units
with this rule and the executor moves them with it, so they match byte for byte.

A storage that a stage after the next saves too (a rotary table or a mask every layer
saves, an encoder's output every decoder layer saves) is in no unit either when the chain
says so (``Stage.shared_saves``, found by the profiler's memory pass): it stays on the device, in
the ops' transients, where its first saver's unit would otherwise be needed from the last
saver's backward on, held whole through most of the backward for one small tensor.  So is
one that the forward saves and then lets go before the backward (``Stage.dropped_saves``:
the graph of an output the model discards died with it), which a unit would count as
memory it frees where it frees nothing.  Such a storage keeps its place in the numbering,
so the other storages keep theirs.

Never part of a unit: storages that live across steps (weights, buffers, gradients,
optimizer state: the chain's constant ``base_bytes``; a parameter or a view of one is
recognized by its type at every save, the rest by storage), the step's input batch (the
training loop holds it anyway), and tensors a copy engine cannot move as plain bytes
(on another device than the model, e.g. the CPU random-number state that flash attention
saves on CUDA; sparse or other non-strided layouts; tensor subclasses such as DTensor or
float8).  A storage is known by a weak reference: once it dies, its address may belong to
a new storage, which starts afresh.
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable, Mapping, NamedTuple

import torch


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` while it lives (shared by all its views)."""
    return t.untyped_storage()._cdata


def plain(t: torch.Tensor) -> bool:
    """A strided tensor of the base classes: its storage is plain bytes (not a DTensor, a
    float8 or other subclass, nor a sparse or other layout, whose storage may not exist)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided


def movable(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a copy engine can move ``t``'s storage as bytes: a plain tensor on ``device``."""
    return plain(t) and t.device == device


def is_weight(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or autocast's cast of one, recognized when it is saved:
    FSDP2's gathered weights are parameters registered during the forward, after any
    snapshot of them, and its reshard frees their storage behind every holder; autocast
    caches a weight's cast for the whole forward, so moving it would free nothing."""
    base = t._base
    return _parameter(t) or cast_parameter(t) is not None or (
        base is not None and (_parameter(base) or cast_parameter(base) is not None))


def _parameter(t: torch.Tensor) -> bool:
    """``isinstance(t, nn.Parameter)``, without the Python ``__instancecheck__`` for a plain
    tensor that is not marked as one (every activation: the check runs at each new save)."""
    return isinstance(t, torch.nn.Parameter) if type(t) is not torch.Tensor else getattr(t, "_is_param", False)


def cast_parameter(t: torch.Tensor) -> torch.nn.Parameter | None:
    """The parameter ``t`` is a dtype cast of (``ToCopyBackward0`` -> its ``AccumulateGrad``), if any."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return None
    variable = getattr(fn.next_functions[0][0], "variable", None)
    return variable if isinstance(variable, torch.nn.Parameter) else None


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def among(t: torch.Tensor, storages: Mapping[int, weakref.ref]) -> bool:
    """Whether ``t``'s storage is one of ``storages`` (storage key -> the storage, known while it
    lives: a dead one's key may be a new storage's)."""
    ref = storages.get(storage_key(t))
    return ref is not None and ref() is t.untyped_storage()


class Saved(NamedTuple):
    """A saved tensor's storage, as the tracker knows it (a tuple: one is made per save)."""

    key: int  # storage_key, valid while the storage lives
    unit: int  # the first stage that saved it
    index: int  # its place among the unit's storages, in first-save order
    nbytes: int
    new: bool  # first time this step


class UnitTracker:
    """Attribute saved tensors to units (module docstring); ``stage`` is the stage running now."""

    def __init__(self, device: torch.device, excluded: Iterable[torch.Tensor] = (),
                 staying: Mapping[int, Iterable[int]] | None = None,
                 filling: Callable[[], Iterable[torch.Tensor]] | None = None) -> None:
        self.device = device
        # storage key -> the storage, while it lives (a storage replaced within the step, a
        # state the model keeps on itself, frees its key for a new one, which is not excluded)
        self.excluded: dict[int, weakref.ref] = {}
        self.exclude(excluded)
        # where the model may still keep new tensors across steps (its first step: a cache its
        # first call fills), what it keeps now: asked as each storage is first saved
        self.filling = filling
        # stage -> indices of its first saves in no unit (``Stage.staying``: shared or dropped saves)
        self.staying = {k: frozenset(v) for k, v in (staying or {}).items()}
        self.stage = 1
        self.reset()

    def reset(self) -> None:
        """A new step: every storage starts afresh."""
        self.stage = 1
        self._refs: dict[int, weakref.ref] = {}
        self._record_refs: list[weakref.ref] = []  # per record, its storage
        self._known: dict[int, int] = {}  # live storage key -> its record
        self.records: list[Saved] = []  # every storage saved this step, in first-save order
        self.last: list[int] = []  # per record, the last stage that saved it
        self.read_in: list[int] = []  # per record, the latest stage whose backward's window read it (0: none)
        self.count: dict[int, int] = {}  # unit -> storages so far
        self.unit_bytes: dict[int, int] = {}  # unit -> bytes so far
        self.saves: dict[int, int] = {}  # unit -> its storages' saves so far (each a handle when the unit is handled)
        self._staying: dict[int, weakref.ref] = {}  # live storage key -> the storage, of those that stay

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never attribute these storages (the step's input batch, say)."""
        self.excluded.update((storage_key(t), weakref.ref(t.untyped_storage())) for t in tensors if plain(t))

    def saw(self, t: torch.Tensor) -> Saved | None:
        """The storage of a tensor being saved now, or ``None`` if it is never part of a unit."""
        if not movable(t, self.device):
            return None
        storage = t.untyped_storage()
        key = storage._cdata
        excluded = self.excluded.get(key)
        if excluded is not None and excluded() is storage:
            return None
        ref = self._refs.get(key)
        if (ref is None or ref() is not storage) and self.filling is not None \
                and key in {storage_key(v) for v in self.filling() if plain(v)}:
            self.excluded[key] = weakref.ref(storage)
            return None
        if ref is not None and ref() is storage:  # known this step: not a weight (checked when new)
            n = self._known[key]
            self.last[n] = self.stage
            known = self.records[n]
            self.saves[known.unit] += 1
            return Saved(key, known.unit, known.index, known.nbytes, False)
        stays = self._staying.get(key)
        if stays is not None and stays() is storage:
            return None
        if is_weight(t):  # the per-tensor checks cost host time: only for storages not seen yet
            return None
        index = self.count.get(self.stage, 0)
        self.count[self.stage] = index + 1
        if index in self.staying.get(self.stage, ()):
            self._staying[key] = weakref.ref(storage)
            return None
        ref = self._refs[key] = weakref.ref(storage)  # new, or an address reused by a new storage
        self._record_refs.append(ref)
        self.unit_bytes[self.stage] = self.unit_bytes.get(self.stage, 0) + storage.nbytes()
        saved = Saved(key, self.stage, index, storage.nbytes(), True)
        self._known[key] = len(self.records)
        self.records.append(saved)
        self.saves[self.stage] = self.saves.get(self.stage, 0) + 1
        self.last.append(self.stage)
        self.read_in.append(0)
        return saved

    def read(self, t: torch.Tensor, stage: int) -> None:
        """The backward reads saved tensor ``t`` in stage ``stage``'s window (between the
        boundaries that begin and end ``B_stage``)."""
        key = storage_key(t) if plain(t) else None
        ref = self._refs.get(key) if key is not None else None
        if ref is not None and ref() is t.untyped_storage():
            n = self._known[key]
            self.read_in[n] = max(self.read_in[n], stage)

    def stays(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is one of those in no unit that stay (``staying``), as seen."""
        return plain(t) and among(t, self._staying)

    def record_of(self, key: int) -> Saved | None:
        """The record of the live storage ``key`` if it was saved this step (``None`` otherwise)."""
        ref = self._refs.get(key)
        return self.records[self._known[key]] if ref is not None and ref() is not None else None

    def shared_saves(self, L: int) -> list[tuple[int, ...]]:
        """Per stage ``1..L``, the indices of the storages it saved first that a stage after the
        next saved too (``Stage.shared_saves``).  One the next stage saves too (a stage's
        output, its input there) stays in the unit: it is needed one op earlier, no more."""
        out: list[list[int]] = [[] for _ in range(L + 1)]
        for s, last in zip(self.records, self.last):
            if last > s.unit + 1:
                out[s.unit].append(s.index)
        return [tuple(v) for v in out[1:]]

    def dropped_saves(self, L: int) -> list[tuple[int, ...]]:
        """Per stage ``1..L``, the indices of the storages it saved first that are already gone:
        read as the forward ends, those that no backward will read, saved by autograd nodes the
        forward made and then let go (the graph of an output the model computes and discards,
        such as BigBird's attention probabilities: ``Stage.dropped_saves``)."""
        out: list[list[int]] = [[] for _ in range(L + 1)]
        for s, ref in zip(self.records, self._record_refs):
            if ref() is None:
                out[s.unit].append(s.index)
        return [tuple(v) for v in out[1:]]

    def storage_counts(self, L: int) -> list[int]:
        """Per stage ``1..L``, the storages of its unit (what a copy of the unit issues one each of)."""
        counts = [0] * (L + 1)
        for s in self.records:
            counts[s.unit] += 1
        return counts[1:]

    def save_counts(self, L: int) -> list[int]:
        """Per stage ``1..L``, the saves of its unit's storages (``Stage.saves``)."""
        return [self.saves.get(k, 0) for k in range(1, L + 1)]

    def units(self, L: int) -> tuple[list[int], list[int]]:
        """(bytes of each unit, need_from of each unit), stages ``1..L`` (a unit's ``need_from``
        is the latest last saver among its storages, or the latest backward window seen reading
        one, at least its own stage)."""
        saved, need = [0] * (L + 1), list(range(L + 1))
        for s, last, read in zip(self.records, self.last, self.read_in):
            saved[s.unit] += s.nbytes
            need[s.unit] = max(need[s.unit], last, read)
        return saved[1:], need[1:]
