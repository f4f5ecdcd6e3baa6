"""The chain model (docs/model.md): stages, their units, the platform, the recipe.

A chain has stages ``1..L``; the GPU runs ``F1..FL`` then ``BL..B1``.  Stage ``i`` saves a
*unit* ``Ui`` of ``saved_bytes`` for its backward, the thing that can be offloaded, and may
offer *encodings* of part of it (``encoding`` gives their meaning).  The platform
gives the copy bandwidths.  A profiled chain carries its *recipe*: how its model is
rebuilt and cut, so that the executor runs the step the chain describes.  A chain writes
its own canonical document (``Chain.document``; its hash is the chain's identity);
``chainfile`` reads and validates documents.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Iterable, Mapping

import numpy as np

CHAIN_FORMAT = "offload-chain/2"  # what ``document`` writes; ``chainfile`` reads it and older ones


@dataclass(frozen=True)
class EncodedTensor:
    """One storage of a unit stored encoded: its place among the unit's storages (in the
    order the forward saves them), the encoder, its raw and encoded size, whether it is the
    stage's output (then it stays alive, raw, as the next stage's input), and the temporary
    memory the encoder or the decoder needs beyond its input and output."""

    index: int
    encoder: str
    nbytes: int
    encoded_bytes: int
    output: bool = False
    workspace_bytes: int = 0


@dataclass(frozen=True)
class Encoding:
    """One way to store part of a unit in fewer bytes (Gist, Layrub): which storages, with
    which encoders, what it costs (``encode_s`` in the forward, ``decode_s`` in the backward)
    and whether gradients stay bit-exact (``lossless``).

    What its ops hold beyond the encoded unit (``fwd_extra_bytes``, ``next_extra_bytes``,
    ``bwd_extra``) is measured where the profiler ran the executor with the encoding on
    (``offload.profiler.encoded_memory``: ``fwd_held_bytes``, ``next_held_bytes``,
    ``bwd_held_bytes``, possibly negative: a covered raw storage dies as the forward drops it,
    a decoded one once its last reader has read it); else an upper bound (docs/encodings.md)."""

    name: str
    lossless: bool
    encode_s: float
    decode_s: float
    tensors: tuple[EncodedTensor, ...]
    fwd_held_bytes: int | None = None  # Fi: bytes over its raw peak, measured with the encoding on
    next_held_bytes: int | None = None  # F(i+1): the same
    bwd_held_bytes: tuple[int, ...] | None = None  # Bi, B(i+1) .. B(need_i): each op's, over its transient

    @property
    def covered_bytes(self) -> int:
        """Raw bytes of the unit this encoding replaces."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def encoded_bytes(self) -> int:
        """What the covered storages take once encoded."""
        return sum(t.encoded_bytes for t in self.tensors)

    @property
    def output_bytes(self) -> int:
        """Covered raw bytes that stay alive as the next stage's input."""
        return sum(t.nbytes for t in self.tensors if t.output)

    @property
    def workspace_bytes(self) -> int:
        """Temporary memory of the codecs, which run one storage at a time."""
        return max((t.workspace_bytes for t in self.tensors), default=0)

    @property
    def fwd_extra_bytes(self) -> int:
        """What ``Fi`` holds on top of its raw peak: measured, else the bound, the encoded copies
        and the encoder's workspace."""
        return self.encoded_bytes + self.workspace_bytes if self.fwd_held_bytes is None else self.fwd_held_bytes

    @property
    def next_extra_bytes(self) -> int:
        """What ``F(i+1)`` holds on top of its raw peak: measured, else the bound, the covered
        raw output (alive as its input)."""
        return self.output_bytes if self.next_held_bytes is None else self.next_held_bytes

    def bwd_extra(self, after: int) -> int:
        """What ``B(i + after)`` (``after`` from 0 to ``need_i - i``) holds on top of its
        transient and the encoded unit: measured, else the bound, the decoded storages and the
        decoder's workspace."""
        if self.bwd_held_bytes is None:
            return self.covered_bytes + self.workspace_bytes
        return self.bwd_held_bytes[after]


MATMULS = "matmuls"  # the option that keeps what the expensive ops output (torchtitan's "save the matmuls")
EVERY_OTHER_MATMUL = "every-other-matmul"  # the same but every second matmul re-run (torchtitan's default "op" policy)


@dataclass(frozen=True)
class StageOption:
    """A way to keep part of a stage's unit and re-run the rest before its backward, measured by
    the profiler (``offload.profiler.selective``): ``matmuls`` keeps what the matmuls,
    convolutions and attention kernels made (``kept_bytes``) and re-runs the other forward
    ops (``recompute_s``); ``every-other-matmul`` re-runs every second matmul too.  A schedule chooses one as a recomputed run of the stage
    (``Recompute.option``; docs/model.md, "In-stage options")."""

    name: str
    kept_bytes: int
    recompute_s: float
    fwd_peak_bytes: int | None = None  # Fi's transient with the kept outputs held (None: recomputed_fwd_peak + kept)
    rerun_peak_bytes: int | None = None  # the re-run's transient over its checkpoint and kept outputs (None: fwd_peak_bytes)
    fwd_s: float | None = None  # Fi's time while the option records what it keeps (None: the stage's fwd_s)
    kept_storages: int = 0  # the distinct storages of the kept outputs: an offloaded checkpoint copies each (0: not counted)


def staying_saves(shared: Iterable[int], dropped: Iterable[int]) -> tuple[int, ...]:
    """A stage's first saves (by their number in first-save order) that are in no unit: those
    a stage after the next saves too (``shared_saves``) and those the forward lets go before
    the backward (``dropped_saves``)."""
    return tuple(sorted({*shared, *dropped}))


@dataclass(frozen=True)
class Stage:
    """One stage: its op durations (s) and the memory it holds (bytes)."""

    name: str
    kind: str
    fwd_s: float
    bwd_s: float
    saved_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    need_from: int  # 1-based index of the first backward op that reads this unit
    encodings: tuple[Encoding, ...] = ()
    held_bytes: int = 0  # of the unit, kept alive by the model's own code (not autograd) ...
    held_until: int = 0  # ... through the forward of this stage, even when the unit is released earlier
    input_bytes: int = 0  # the stage's input: what a recomputation from it keeps on the device until it runs
    recomputable: bool = True  # the executor can re-run this stage's forward (the profiler says when it cannot)
    rerun_output: bool = True  # its re-run rebuilds its output too, so a recomputed run may go on past it
    carry_bytes: int | None = None  # of the unit, alive through F(i+1) when autograd holds none of it (None: all)
    bwd_start_bytes: int = 0  # of Bi's transient, live when it starts (the gradient flowing in): a rebuild there holds it
    recomputed_fwd_peak_bytes: int | None = None  # Fi's transient when autograd keeps none of Ui (None: fwd_peak_bytes)
    rerun_peak_bytes: int | None = None  # Fi re-run whole: its transient over its input, measured (None: fwd_peak_bytes)
    rebuilt_bytes: int | None = None  # of Ui, what a rebuild keeps live through Bi (None: all; a compiled backward
    # re-runs each op just before its reader and frees it after, holding less)
    input_carried_bytes: int = 0  # of input_bytes, storages of Ui that carry_bytes counts too ...
    input_held_bytes: int = 0  # ... and that held_bytes counts too (a checkpoint holds them once)
    carried_early_bytes: int = 0  # of the unit, beside carry_bytes, what the model's code lets go as F(i+1) starts
    carried_late_bytes: int = 0  # of carry_bytes (not held), what the model's code lets go only as F(i+2) starts ...
    input_late_bytes: int = 0  # ... and of that, storages of the input (a run starting at i holds them as its checkpoint)
    held_late_bytes: int = 0  # of held_bytes, what the model's code lets go only as F(held_until+1) starts ...
    input_held_late_bytes: int = 0  # ... and of that, storages of the input
    fwd_start_bytes: int = 0  # of fwd_peak_bytes, live as Fi starts: F(i-1)'s last reading, where a late part counts too
    rerun_held_bytes: int = 0  # of input_bytes, held tensors its re-run reads and the stage before's does not
    input_own_bytes: int = 0  # of input_bytes, the input's own storage: what an offloaded checkpoint moves (0: unknown)
    input_prev_bytes: int = 0  # of input_bytes, storages of U(i-1): a run starting here holds them once beside it ...
    input_prev_held_bytes: int = 0  # ... and of that, what U(i-1)'s held part counts (docs/model.md, "Recomputation")
    fwd_host_s: float = 0.0  # host time to issue Fi's kernels (CUDA; 0: the device is never waiting for the host)
    bwd_host_s: float = 0.0  # the same for Bi
    recording_host_s: float = 0.0  # host time Fi adds while the executor records it for a re-run (CUDA)
    rerun_host_s: float = 0.0  # host time to issue the executor's re-run of Fi (CUDA; 0: fwd_host_s)
    # a stage the executor records for a re-run, measured so: its Fi while recorded, its re-run (the
    # executor's replay), its Bi after the rebuild.  On a CPU, whose host is the device, the recording's
    # and the replay's own work is in them; under a per-stage torch.compile by Inductor the eager model's
    # kernels are (rerun._EagerWhileRecording).  None: fwd_s, fwd_s, bwd_s (the ops the chain timed)
    recorded_fwd_s: float | None = None
    rerun_s: float | None = None
    recorded_bwd_s: float | None = None  # (their names in order: RECORDED_TIMES)
    storages: int = 0  # distinct storages in the unit: a copy of it issues one each (0: not counted)
    saves: int = 0  # saved tensors of the unit's storages in a step: each a handle when it moves or is rebuilt (0: not counted)
    moved_bytes: int | None = None  # what a copy of the unit moves each way, where less than the unit (None: all of
    # it): a compiled graph's copy moves the extent of each storage its values span, its release frees the storage
    options: tuple[StageOption, ...] = ()  # in-stage options, measured: a recomputed run may choose one
    cast_bytes: int = 0  # weight casts (autocast) Fi makes and Bi reads: dropped and made again unless kept ...
    recast_s: float = 0.0  # ... what making them again costs Bi (part of bwd_s): docs/model.md, "Weight casts"
    shared_saves: tuple[int, ...] = ()  # Fi's first saves a stage after the next saves too: in no unit ...
    dropped_saves: tuple[int, ...] = ()  # ... nor those the forward lets go before the backward (a discarded output's)
    held_saves: tuple[int, ...] = ()  # the storages of the unit held_bytes counts (indices in first-save order) ...
    held_read_at: int = 0  # ... and the first forward after F(i+1) that reads one (0: none): an offloaded unit's
    # held part may leave the device at its release and come back for that forward (``Offload.restore``)

    @property
    def recomputed_fwd_peak(self) -> int:
        """``Fi``'s transient when its unit is recomputed: its saved tensors die as its code drops them."""
        return self.fwd_peak_bytes if self.recomputed_fwd_peak_bytes is None else self.recomputed_fwd_peak_bytes

    @property
    def rebuilt(self) -> int:
        """Bytes of the unit resident from its rebuild through ``Bi`` when it is recomputed."""
        return self.saved_bytes if self.rebuilt_bytes is None else self.rebuilt_bytes

    @property
    def recorded_fwd(self) -> float:
        """``Fi``'s time when the executor records it for a re-run."""
        return self.fwd_s if self.recorded_fwd_s is None else self.recorded_fwd_s

    @property
    def rerun(self) -> float:
        """The time of the executor's re-run of ``Fi`` whole."""
        return self.fwd_s if self.rerun_s is None else self.rerun_s

    @property
    def recorded_bwd(self) -> float:
        """``Bi``'s time after a re-run rebuilt its unit."""
        return self.bwd_s if self.recorded_bwd_s is None else self.recorded_bwd_s

    @property
    def rerun_host(self) -> float:
        """The host's time to issue a re-run of ``Fi``: measured, else ``Fi``'s own."""
        return self.rerun_host_s or self.fwd_host_s

    @property
    def moved(self) -> int:
        """Bytes a copy of the unit moves, each way (its copies' time: docs/model.md, "Schedules")."""
        return self.saved_bytes if self.moved_bytes is None else self.moved_bytes

    @property
    def carried(self) -> int:
        """Bytes of the unit a recomputation still finds alive during the next stage's forward."""
        return self.saved_bytes if self.carry_bytes is None else self.carry_bytes

    @property
    def staying(self) -> tuple[int, ...]:
        """Fi's first saves that are in no unit: they stay where the model's autograd graph keeps
        them, their bytes in the transients (``staying_saves``)."""
        return staying_saves(self.shared_saves, self.dropped_saves)

    def option(self, name: str) -> StageOption:
        """The in-stage option called ``name`` (``KeyError`` if the stage offers none by that name)."""
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(name)

    def encoding(self, name: str) -> Encoding:
        """The encoding called ``name`` (``KeyError`` if the stage offers none by that name)."""
        for e in self.encodings:
            if e.name == name:
                return e
        raise KeyError(name)


@dataclass(frozen=True)
class Platform:
    """Copy engines between GPU and host: bandwidths (B/s) and per-copy latency (s)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    latency_s: float = 0.0
    note: str = ""
    # the executor's host time per storage it copies, either way: its slot or buffer, the copy's
    # issue, its events and the wait for it (CUDA, measured; 0: the host's part not charged)
    copy_host_s: float = 0.0
    # the executor's host time per saved tensor of a unit it moves, encodes or rebuilds, each way,
    # beyond the profiled hooks': the handle at pack, its checks and view at unpack (CUDA, measured)
    handle_host_s: float = 0.0
    # the same works where the host runs the ops itself (a CPU, measured there): they lengthen the
    # ops rather than their issue, a copy's the op that issues it, a handled unit's Fi and Bi
    copy_device_s: float = 0.0
    handle_device_s: float = 0.0

    def d2h_s(self, nbytes: float) -> float:
        """Duration of one device-to-host copy of ``nbytes``."""
        return self.latency_s + nbytes / self.d2h_bytes_per_s

    def h2d_s(self, nbytes: float) -> float:
        """Duration of one host-to-device copy of ``nbytes``."""
        return self.latency_s + nbytes / self.h2d_bytes_per_s


@dataclass(frozen=True)
class Recipe:
    """How a profiled chain's model is rebuilt and cut: the model string and its options, the
    batch size, dtype and seed, the optimizer (its state is ``base_bytes``), the call sites
    where stages end (``offload.core.staging.Site`` texts) and the signature of the batch
    (``name:dtype[shape]`` per input tensor: ``0:float32[8,3,224,224]``, ``input_ids:int64[8,128]``)
    and the autocast dtype the forward and loss ran under, if any, and whether gradients were
    freed between steps (``zero_grad(set_to_none=True)``: then they are allocated during the
    backward and counted in its ops' memory, not in ``base_bytes``), and whether the profiler
    turned the model's key/value cache off (``cache_off``: its transformers config asked for
    one, ``use_cache=True``, which a training step has no use for and which keeps every block
    from being recomputed; training must turn it off too), and whether autocast's cache of
    weight casts was cleared at every stage boundary (``casts_cleared``: training must too)
    or off through the model's forward (``casts_uncached``: the same),
    and the ``torch.compile`` backend the model was profiled under (``compile``: its compiled
    stages save other tensors than its eager code, so training must compile it alike), and
    whether it was compiled as one graph (``whole_graph``: the chain's units and times are that
    graph's, ``offload.profiler.compiled``; only ``compile_scheduled`` runs it).
    Part of the chain's identity: a schedule made for one recipe is refused for another."""

    model: str
    batch: int
    options: Mapping[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    seed: int = 0
    optimizer: str = "adam"
    cuts: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    autocast: str | None = None  # "bfloat16" | "float16": profiled under torch.autocast to this dtype
    compile: str | None = None  # profiled compiled (torch.compile with this backend; a graph break at each boundary) ...
    whole_graph: bool = False  # ... or as one graph with the schedule in it (offload.executor.compiled)
    set_to_none: bool = False  # gradients freed between steps, allocated by the backward
    cache_off: bool = False  # the model's key/value cache (config.use_cache) turned off for training
    casts_cleared: bool = False  # autocast's cached weight casts forgotten at every stage boundary
    casts_uncached: bool = False  # autocast's cache of weight casts off through the forward: each dies with its reader


RECORDED_TIMES = ("recorded_fwd_s", "rerun_s", "recorded_bwd_s")  # a stage's times recorded for a re-run


def _column(field: str, dtype: type = np.int64) -> cached_property:
    """A ``Chain`` property: the stages' ``field`` as an array, index 0 unused (``a[i]`` is stage i)."""
    def column(chain: "Chain") -> np.ndarray:
        return np.array([0] + [getattr(s, field) for s in chain.stages], dtype=dtype)
    return cached_property(column)


def _encodings_document(encodings: tuple[Encoding, ...]) -> list[dict]:
    return [{"name": e.name, "lossless": e.lossless, "encode_s": e.encode_s, "decode_s": e.decode_s,
             "tensors": [{"index": t.index, "encoder": t.encoder, "bytes": t.nbytes, "encoded_bytes": t.encoded_bytes,
                          "output": t.output, "workspace_bytes": t.workspace_bytes} for t in e.tensors],
             **_measured_document(e)}
            for e in encodings]


def _measured_document(e: Encoding) -> dict[str, Any]:
    """An encoding's measured op memory: absent where it is not measured (older chains keep their sha256)."""
    d: dict[str, Any] = {}
    if e.fwd_held_bytes is not None:
        d["fwd_held_bytes"] = e.fwd_held_bytes
    if e.next_held_bytes is not None:
        d["next_held_bytes"] = e.next_held_bytes
    if e.bwd_held_bytes is not None:
        d["bwd_held_bytes"] = list(e.bwd_held_bytes)
    return d


def _option_document(o: StageOption) -> dict[str, Any]:
    d: dict[str, Any] = {"name": o.name, "kept_bytes": o.kept_bytes, "recompute_s": o.recompute_s}
    for key in ("fwd_peak_bytes", "rerun_peak_bytes", "fwd_s"):  # absent when not measured: older chains keep their sha256
        if getattr(o, key) is not None:
            d[key] = getattr(o, key)
    if o.kept_storages:  # likewise
        d["kept_storages"] = o.kept_storages
    return d


def _stage_document(s: Stage) -> dict:
    d: dict[str, Any] = {"name": s.name, "kind": s.kind, "fwd_s": s.fwd_s, "bwd_s": s.bwd_s, "saved_bytes": s.saved_bytes,
                         "fwd_peak_bytes": s.fwd_peak_bytes, "bwd_peak_bytes": s.bwd_peak_bytes, "need_from": s.need_from}
    if s.encodings:
        d["encodings"] = _encodings_document(s.encodings)
    if s.held_bytes:
        d.update(held_bytes=s.held_bytes, held_until=s.held_until)
    if s.input_bytes:  # absent otherwise: chains from before recomputation keep their sha256
        d["input_bytes"] = s.input_bytes
    if not s.recomputable:  # likewise: written only where the profiler found a stage it cannot re-run
        d["recomputable"] = False
    if not s.rerun_output:  # likewise: a stage that can only end a recomputed run
        d["rerun_output"] = False
    if s.carry_bytes is not None:
        d["carry_bytes"] = s.carry_bytes
    if s.bwd_start_bytes:
        d["bwd_start_bytes"] = s.bwd_start_bytes
    if s.recomputed_fwd_peak_bytes is not None:
        d["recomputed_fwd_peak_bytes"] = s.recomputed_fwd_peak_bytes
    if s.rerun_peak_bytes is not None:  # absent otherwise: chains from before it keep their sha256
        d["rerun_peak_bytes"] = s.rerun_peak_bytes
    if s.rebuilt_bytes is not None:  # likewise
        d["rebuilt_bytes"] = s.rebuilt_bytes
    if s.fwd_host_s or s.bwd_host_s:  # absent otherwise: chains from before the host lane keep their sha256
        d.update(fwd_host_s=s.fwd_host_s, bwd_host_s=s.bwd_host_s)
    if s.recording_host_s or s.rerun_host_s:  # likewise: chains from before these were measured
        d.update(recording_host_s=s.recording_host_s, rerun_host_s=s.rerun_host_s)
    for key in RECORDED_TIMES:  # likewise: written where measured
        if getattr(s, key) is not None:
            d[key] = getattr(s, key)
    if s.options:  # absent otherwise: chains from before the options keep their sha256
        d["options"] = [_option_document(o) for o in s.options]
    if s.cast_bytes:  # absent otherwise: chains from before the choice keep their sha256
        d.update(cast_bytes=s.cast_bytes, recast_s=s.recast_s)
    if s.input_carried_bytes:
        d["input_carried_bytes"] = s.input_carried_bytes
    if s.input_held_bytes:
        d["input_held_bytes"] = s.input_held_bytes
    if s.carried_early_bytes:  # absent otherwise: chains from before it keep their sha256
        d["carried_early_bytes"] = s.carried_early_bytes
    if s.carried_late_bytes:  # absent otherwise: chains from before them keep their sha256
        d["carried_late_bytes"] = s.carried_late_bytes
    if s.input_late_bytes:  # likewise
        d["input_late_bytes"] = s.input_late_bytes
    if s.held_late_bytes:  # likewise
        d["held_late_bytes"] = s.held_late_bytes
    if s.input_held_late_bytes:  # likewise
        d["input_held_late_bytes"] = s.input_held_late_bytes
    if s.fwd_start_bytes:  # likewise
        d["fwd_start_bytes"] = s.fwd_start_bytes
    if s.rerun_held_bytes:  # absent otherwise: chains from before it keep their sha256
        d["rerun_held_bytes"] = s.rerun_held_bytes
    if s.input_own_bytes:  # likewise
        d["input_own_bytes"] = s.input_own_bytes
    if s.input_prev_bytes:  # likewise
        d["input_prev_bytes"] = s.input_prev_bytes
    if s.input_prev_held_bytes:  # likewise
        d["input_prev_held_bytes"] = s.input_prev_held_bytes
    if s.shared_saves:  # likewise
        d["shared_saves"] = list(s.shared_saves)
    if s.dropped_saves:  # likewise
        d["dropped_saves"] = list(s.dropped_saves)
    if s.held_read_at:  # likewise
        d.update(held_saves=list(s.held_saves), held_read_at=s.held_read_at)
    if s.storages:  # likewise
        d["storages"] = s.storages
    if s.saves:  # likewise
        d["saves"] = s.saves
    if s.moved_bytes is not None:  # likewise
        d["moved_bytes"] = s.moved_bytes
    return d


@dataclass(frozen=True)
class Chain:
    """A validated chain.  Stage indices in the API are 1-based, like the model."""

    name: str
    stages: tuple[Stage, ...]
    platform: Platform
    base_bytes: int = 0
    source: Mapping[str, Any] = field(default_factory=dict)  # provenance: not part of the identity
    recipe: Recipe | None = None  # None: a chain not profiled from a model (synthetic, hand-made)
    # Of base_bytes, the device memory that no tensor holds and that stays from step to step
    # (cuBLAS/cuDNN workspaces made on first use, the allocator's rounding of the base's
    # tensors): measured on CUDA, 0 on the CPU.  A run judges its activations over it.
    workspace_bytes: int = 0

    @property
    def L(self) -> int:
        return len(self.stages)

    def stage(self, i: int) -> Stage:
        """Stage ``i`` (1-based)."""
        return self.stages[i - 1]

    # Per-stage arrays, index 0 unused so that ``a[i]`` is stage i.
    f = _column("fwd_s", np.float64)
    b = _column("bwd_s", np.float64)
    a = _column("saved_bytes")
    mv = _column("moved")
    fp = _column("fwd_peak_bytes")
    bp = _column("bwd_peak_bytes")
    held = _column("held_bytes")
    held_until = _column("held_until")
    held_read = _column("held_read_at")
    need = _column("need_from")
    x = _column("input_bytes")
    carry = _column("carried")
    rb = _column("rebuilt")
    bs = _column("bwd_start_bytes")
    rfp = _column("recomputed_fwd_peak")
    xc = _column("input_carried_bytes")
    xh = _column("input_held_bytes")
    ce = _column("carried_early_bytes")
    cl = _column("carried_late_bytes")
    xl = _column("input_late_bytes")
    hl = _column("held_late_bytes")
    xhl = _column("input_held_late_bytes")
    fs = _column("fwd_start_bytes")
    xn = _column("rerun_held_bytes")
    xo = _column("input_own_bytes")
    xp = _column("input_prev_bytes")
    xph = _column("input_prev_held_bytes")
    fh = _column("fwd_host_s", np.float64)
    bh = _column("bwd_host_s", np.float64)
    rech = _column("recording_host_s", np.float64)
    rh = _column("rerun_host", np.float64)
    fr = _column("recorded_fwd", np.float64)  # Fi recorded for a re-run ...
    rr = _column("rerun", np.float64)  # ... the re-run ...
    br = _column("recorded_bwd", np.float64)  # ... and Bi after it
    ns = _column("storages")
    hh = _column("saves", np.float64)
    cb = _column("cast_bytes")
    rc = _column("recast_s", np.float64)

    @cached_property
    def offloadable(self) -> tuple[int, ...]:
        """Units that a schedule may offload: ``i < L`` (a release point ``r > i`` must
        exist) and ``saved_bytes > 0``."""
        return tuple(i for i in range(1, self.L) if self.a[i] > 0)

    @cached_property
    def restorable(self) -> tuple[int, ...]:
        """Offloadable units whose held part a schedule may take off the device at the release
        and bring back for its next forward reader (``Offload.restore``; docs/model.md)."""
        return tuple(i for i in self.offloadable if self.held_read[i])

    @cached_property
    def recomputable(self) -> frozenset[int]:
        """Stages a schedule may recompute: ``i < L`` whose forward the executor can re-run."""
        return frozenset(i for i in range(1, self.L) if self.stage(i).recomputable)

    def can_recompute(self, first: int, last: int) -> bool:
        """Whether stages ``first..last`` may form a recomputed run: each re-runnable, each but
        the last rebuilding its output (the next one's input)."""
        return (all(i in self.recomputable for i in range(first, last + 1))
                and all(self.stage(i).rerun_output for i in range(first, last)))

    @cached_property
    def optional(self) -> tuple[tuple[int, str], ...]:
        """``(stage, option)``: the in-stage options a schedule may choose (recomputable stages)."""
        return tuple((i, o.name) for i in sorted(self.recomputable) for o in self.stage(i).options)

    def without_options(self) -> "Chain":
        """This chain with no in-stage options: what per-block decisions alone can do (its
        schedules are this chain's, its hash is not)."""
        return replace(self, stages=tuple(replace(s, options=()) for s in self.stages))

    @cached_property
    def castable(self) -> tuple[int, ...]:
        """Stages whose weight casts a schedule may keep (docs/model.md, "Weight casts")."""
        return tuple(i for i in range(1, self.L + 1) if self.cb[i] > 0)

    @cached_property
    def has_encodings(self) -> bool:
        return any(s.encodings for s in self.stages)

    def copied_storages(self, i: int, checkpoint: str | None = None) -> int:
        """The storages one copy of unit ``i`` moves (``ns``), or of the checkpoint a run of
        stage ``i`` with option ``checkpoint`` offloads (``""``: none; its input's storage and
        the option's ``kept_storages``)."""
        if checkpoint is None:
            return int(self.ns[i])
        return 1 + (self.stage(i).option(checkpoint).kept_storages if checkpoint else 0)

    def issue_host_s(self, i: int, checkpoint: str | None = None) -> float:
        """The host's time to issue one way the copy of unit ``i``, or of the checkpoint a run
        of stage ``i`` with option ``checkpoint`` offloads: ``copy_host_s`` per storage it moves
        (docs/model.md, "The host")."""
        return self.platform.copy_host_s * self.copied_storages(i, checkpoint)

    def issue_device_s(self, i: int, checkpoint: str | None = None) -> float:
        """Where the host runs the ops (a CPU), what issuing that copy adds to the op that issues
        it: ``copy_device_s`` per storage it moves."""
        return self.platform.copy_device_s * self.copied_storages(i, checkpoint)

    def handle_host_s(self, i: int) -> float:
        """The host's time, each way, that unit ``i``'s saved tensors add when the executor
        handles them (its unit moved, encoded or rebuilt): ``handle_host_s`` per save."""
        return self.platform.handle_host_s * float(self.hh[i])

    def handle_device_s(self, i: int) -> float:
        """The device's time, each way, that unit ``i``'s saved tensors add to ``Fi`` and ``Bi``
        when the executor handles them, where the host runs the ops (a CPU): ``handle_device_s``
        per save."""
        return self.platform.handle_device_s * float(self.hh[i])

    def restore_host_s(self, i: int) -> float:
        """The host's time to issue the copy that restores unit ``i``'s held part: ``copy_host_s``
        per storage of it (``held_saves``)."""
        return self.platform.copy_host_s * len(self.stage(i).held_saves)

    def restore_device_s(self, i: int) -> float:
        """Where the host runs the ops (a CPU), what issuing that copy adds to the forward op it
        precedes: ``copy_device_s`` per storage of it."""
        return self.platform.copy_device_s * len(self.stage(i).held_saves)

    def d2h_s(self, i: int) -> float:
        """Unit ``i``'s copy to the host: its moved bytes'."""
        return self.platform.d2h_s(float(self.mv[i]))

    def h2d_s(self, i: int) -> float:
        """Unit ``i``'s copy back to the device."""
        return self.platform.h2d_s(float(self.mv[i]))

    @cached_property
    def ideal_makespan_s(self) -> float:
        """The makespan with no stall at all: the sum of all op durations (every weight cast
        kept: no backward recasts), or where the host issues some op later than the device
        could run it, each op ending no earlier than that (docs/model.md, "The host").  Every
        schedule's makespan is at least this."""
        b = self.b - self.rc
        if not (self.fh.any() or self.bh.any()):
            return float(self.f.sum() + b.sum())
        end = host = 0.0
        L = self.L
        for d, h in zip([*self.f[1:], *b[L:0:-1]], [*self.fh[1:], *self.bh[L:0:-1]]):
            host += h
            end = max(end + d, host)
        return float(end)

    @cached_property
    def time_unit_s(self) -> float:
        """The scale of the LP and MILP time variables: the mean op (the mean copy when every
        op takes no time), so that their coefficients are near 1."""
        copies = sum(self.d2h_s(i) + self.h2d_s(i) for i in self.offloadable)
        return max(self.ideal_makespan_s, copies) / (2 * self.L) or 1.0

    @cached_property
    def memory_unit_bytes(self) -> float:
        """The scale of the LP and MILP memory terms: the largest unit."""
        return float(max(int(self.a.max()), 1))

    def document(self) -> dict[str, Any]:
        """The ``chain.json`` document of this chain (all defaults written out): what files hold and,
        less its ``source``, what the chain's ``sha256`` hashes."""
        p = self.platform
        platform: dict[str, Any] = {"d2h_bytes_per_s": p.d2h_bytes_per_s, "h2d_bytes_per_s": p.h2d_bytes_per_s,
                                    "latency_s": p.latency_s}
        if p.note:
            platform["note"] = p.note
        if p.copy_host_s:  # absent otherwise: chains from before it keep their sha256
            platform["copy_host_s"] = p.copy_host_s
        if p.handle_host_s:  # likewise
            platform["handle_host_s"] = p.handle_host_s
        if p.copy_device_s:  # likewise
            platform["copy_device_s"] = p.copy_device_s
        if p.handle_device_s:  # likewise
            platform["handle_device_s"] = p.handle_device_s
        doc: dict[str, Any] = {"format": CHAIN_FORMAT, "name": self.name, "source": dict(self.source),
                               "platform": platform, "base_bytes": self.base_bytes,
                               "stages": [_stage_document(s) for s in self.stages]}
        if self.workspace_bytes:  # absent otherwise: chains from before it keep their sha256
            doc["workspace_bytes"] = self.workspace_bytes
        if self.recipe is not None:
            r = self.recipe
            doc["recipe"] = {"model": r.model, "batch": r.batch, "options": dict(r.options), "dtype": r.dtype,
                             "seed": r.seed, "optimizer": r.optimizer, "cuts": list(r.cuts), "inputs": list(r.inputs)}
            if r.autocast is not None:  # absent otherwise: chains from before autocast keep their sha256
                doc["recipe"]["autocast"] = r.autocast
            if r.set_to_none:  # the same
                doc["recipe"]["set_to_none"] = True
            if r.cache_off:  # the same
                doc["recipe"]["cache_off"] = True
            if r.casts_cleared:  # the same
                doc["recipe"]["casts_cleared"] = True
            if r.casts_uncached:  # the same
                doc["recipe"]["casts_uncached"] = True
            if r.compile is not None:  # the same
                doc["recipe"]["compile"] = r.compile
            if r.whole_graph:  # the same
                doc["recipe"]["whole_graph"] = True
        return doc

    @cached_property
    def sha256(self) -> str:
        """Hash of the canonical document without ``source`` (provenance), binding schedules to it."""
        body = self.document()
        body.pop("source")
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
