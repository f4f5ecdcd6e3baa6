"""The chain model and its file format, ``offload-chain/1`` (DESIGN sections 3-4).

A chain has stages ``1..L``; the GPU runs ``F1..FL`` then ``BL..B1``.  Stage ``i`` saves a
*unit* ``Ui`` of ``saved_bytes`` for its backward, the thing that can be offloaded, and may
offer *encodings* of part of it (``solver.encoding`` gives their meaning).  The platform
gives the copy bandwidths.  Files are validated field by field on load, so a
malformed chain is refused with a message naming the field, never half-used.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, Mapping

import numpy as np

from .errors import FormatError
from .fileio import read_json, write_json

CHAIN_FORMAT = "offload-chain/1"
CHANNEL_MODES = ("duplex", "shared")
_STAGE_KEYS = {"name", "kind", "fwd_s", "bwd_s", "saved_bytes", "fwd_peak_bytes", "bwd_peak_bytes", "need_from", "encodings"}
_ENCODING_KEYS = {"name", "lossless", "encode_s", "decode_s", "tensors"}
_TENSOR_KEYS = {"index", "encoder", "bytes", "encoded_bytes", "output", "workspace_bytes"}
_PLATFORM_KEYS = {"d2h_bytes_per_s", "h2d_bytes_per_s", "latency_s", "channels", "note"}


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
    and whether gradients stay bit-exact (``lossless``)."""

    name: str
    lossless: bool
    encode_s: float
    decode_s: float
    tensors: tuple[EncodedTensor, ...]

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
        """What ``Fi`` holds on top of its raw peak: the encoded copies and the encoder's workspace."""
        return self.encoded_bytes + self.workspace_bytes

    @property
    def bwd_extra_bytes(self) -> int:
        """What ``B(need_i) .. Bi`` hold on top of the encoded unit: the decoded storages and
        the decoder's workspace."""
        return self.covered_bytes + self.workspace_bytes


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

    def encoding(self, name: str) -> Encoding:
        """The encoding called ``name`` (``KeyError`` if the stage offers none by that name)."""
        for e in self.encodings:
            if e.name == name:
                return e
        raise KeyError(name)


@dataclass(frozen=True)
class Platform:
    """Copy engines between GPU and host: bandwidths (B/s), per-copy latency (s), channel mode."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    latency_s: float = 0.0
    channels: str = "duplex"
    note: str = ""

    def d2h_s(self, nbytes: float) -> float:
        """Duration of one device-to-host copy of ``nbytes``."""
        return self.latency_s + nbytes / self.d2h_bytes_per_s

    def h2d_s(self, nbytes: float) -> float:
        """Duration of one host-to-device copy of ``nbytes``."""
        return self.latency_s + nbytes / self.h2d_bytes_per_s


@dataclass(frozen=True)
class Chain:
    """A validated chain.  Stage indices in the API are 1-based, like the model."""

    name: str
    stages: tuple[Stage, ...]
    platform: Platform
    base_bytes: int = 0
    source: Mapping[str, Any] = field(default_factory=dict)

    @property
    def L(self) -> int:
        return len(self.stages)

    def stage(self, i: int) -> Stage:
        """Stage ``i`` (1-based)."""
        return self.stages[i - 1]

    # Per-stage arrays, index 0 unused so that ``a[i]`` is stage i.
    @cached_property
    def f(self) -> np.ndarray:
        return np.array([0.0] + [s.fwd_s for s in self.stages])

    @cached_property
    def b(self) -> np.ndarray:
        return np.array([0.0] + [s.bwd_s for s in self.stages])

    @cached_property
    def a(self) -> np.ndarray:
        return np.array([0] + [s.saved_bytes for s in self.stages], dtype=np.int64)

    @cached_property
    def fp(self) -> np.ndarray:
        return np.array([0] + [s.fwd_peak_bytes for s in self.stages], dtype=np.int64)

    @cached_property
    def bp(self) -> np.ndarray:
        return np.array([0] + [s.bwd_peak_bytes for s in self.stages], dtype=np.int64)

    @cached_property
    def need(self) -> np.ndarray:
        return np.array([0] + [s.need_from for s in self.stages], dtype=np.int64)

    @cached_property
    def offloadable(self) -> tuple[int, ...]:
        """Units that a schedule may offload: ``i < L`` (a release point ``r > i`` must
        exist) and ``saved_bytes > 0``."""
        return tuple(i for i in range(1, self.L) if self.a[i] > 0)

    @cached_property
    def has_encodings(self) -> bool:
        return any(s.encodings for s in self.stages)

    def d2h_s(self, i: int) -> float:
        return self.platform.d2h_s(float(self.a[i]))

    def h2d_s(self, i: int) -> float:
        return self.platform.h2d_s(float(self.a[i]))

    @cached_property
    def ideal_makespan_s(self) -> float:
        """Sum of all op durations: the makespan with no stall at all."""
        return float(self.f.sum() + self.b.sum())

    @cached_property
    def sha256(self) -> str:
        """Hash of the canonical chain (everything but ``source``), binding schedules to it."""
        body = to_dict(self)
        body.pop("source")
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- validation helpers
def _where(ctx: str, key: str) -> str:
    return f"{ctx}.{key}" if ctx else key


def _number(d: Mapping, key: str, ctx: str, minimum: float = 0.0, strict: bool = False) -> float:
    if key not in d:
        raise FormatError(f"missing field '{_where(ctx, key)}'")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise FormatError(f"'{_where(ctx, key)}' must be a finite number, got {v!r}")
    if v < minimum or (strict and v == minimum):
        op = ">" if strict else ">="
        raise FormatError(f"'{_where(ctx, key)}' must be {op} {minimum}, got {v!r}")
    return float(v)


def _bytes(d: Mapping, key: str, ctx: str) -> int:
    v = _number(d, key, ctx)
    if v != int(v):
        raise FormatError(f"'{_where(ctx, key)}' must be a whole number of bytes, got {d[key]!r}")
    return int(v)


def _string(d: Mapping, key: str, ctx: str, default: str | None = None) -> str:
    if key not in d:
        if default is not None:
            return default
        raise FormatError(f"missing field '{_where(ctx, key)}'")
    v = d[key]
    if not isinstance(v, str) or not v:
        raise FormatError(f"'{_where(ctx, key)}' must be a non-empty string, got {v!r}")
    return v


def _no_unknown(d: Mapping, allowed: set[str], ctx: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise FormatError(
            f"unknown field(s) {', '.join(repr(k) for k in unknown)} in {ctx}",
            f"allowed fields: {', '.join(sorted(allowed))}",
        )


def _flag(d: Mapping, key: str, ctx: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise FormatError(f"'{_where(ctx, key)}' must be true or false, got {v!r}")
    return v


def _objects(raw: list, ctx: str, allowed: set[str]) -> Iterator[tuple[str, Mapping]]:
    """Each item of a list of objects with its context, refused unless it is an object with
    only ``allowed`` fields."""
    for n, item in enumerate(raw):
        where = f"{ctx}[{n}]"
        if not isinstance(item, Mapping):
            raise FormatError(f"{where} must be an object")
        _no_unknown(item, allowed, where)
        yield where, item


def _encodings_from_list(raw: Any, saved: int, ctx: str) -> tuple[Encoding, ...]:
    """Validate a stage's ``encodings``: names unique, sizes consistent with the unit."""
    if not isinstance(raw, list):
        raise FormatError(f"{ctx}.encodings must be a list")
    out, names = [], set()
    for ectx, e in _objects(raw, f"{ctx}.encodings", _ENCODING_KEYS):
        name = _string(e, "name", ectx)
        if name in names:
            raise FormatError(f"{ectx}.name {name!r} is used twice in this stage")
        names.add(name)
        tensors_raw = e.get("tensors")
        if not isinstance(tensors_raw, list) or not tensors_raw:
            raise FormatError(f"{ectx}.tensors must be a non-empty list")
        tensors, seen = [], set()
        for tctx, t in _objects(tensors_raw, f"{ectx}.tensors", _TENSOR_KEYS):
            index = t.get("index")
            if isinstance(index, bool) or not isinstance(index, int) or index < 0 or index in seen:
                raise FormatError(f"{tctx}.index must be a distinct integer >= 0, got {index!r}")
            seen.add(index)
            tensors.append(EncodedTensor(index, _string(t, "encoder", tctx), _bytes(t, "bytes", tctx),
                                         _bytes(t, "encoded_bytes", tctx), _flag(t, "output", tctx, False),
                                         _bytes(t, "workspace_bytes", tctx) if "workspace_bytes" in t else 0))
        enc = Encoding(name, _flag(e, "lossless", ectx, False), _number(e, "encode_s", ectx),
                       _number(e, "decode_s", ectx), tuple(tensors))
        if enc.covered_bytes > saved:
            raise FormatError(f"{ectx} covers {enc.covered_bytes} bytes, more than the unit's saved_bytes ({saved})")
        out.append(enc)
    return tuple(out)


def _encodings_to_list(encodings: tuple[Encoding, ...]) -> list[dict]:
    return [{"name": e.name, "lossless": e.lossless, "encode_s": e.encode_s, "decode_s": e.decode_s,
             "tensors": [{"index": t.index, "encoder": t.encoder, "bytes": t.nbytes, "encoded_bytes": t.encoded_bytes,
                          "output": t.output, "workspace_bytes": t.workspace_bytes} for t in e.tensors]}
            for e in encodings]


def platform_from_dict(d: Any) -> Platform:
    """Validate a ``platform`` object."""
    if not isinstance(d, Mapping):
        raise FormatError(f"'platform' must be an object, got {type(d).__name__}")
    _no_unknown(d, _PLATFORM_KEYS, "platform")
    channels = _string(d, "channels", "platform", "duplex")
    if channels not in CHANNEL_MODES:
        raise FormatError(f"'platform.channels' must be one of {CHANNEL_MODES}, got {channels!r}")
    note = d.get("note", "")
    if not isinstance(note, str):
        raise FormatError("'platform.note' must be a string")
    return Platform(
        d2h_bytes_per_s=_number(d, "d2h_bytes_per_s", "platform", strict=True),
        h2d_bytes_per_s=_number(d, "h2d_bytes_per_s", "platform", strict=True),
        latency_s=_number(d, "latency_s", "platform") if "latency_s" in d else 0.0,
        channels=channels,
        note=note,
    )


def chain_from_dict(d: Any) -> Chain:
    """Validate a parsed ``chain.json`` document and build the ``Chain``."""
    if not isinstance(d, Mapping):
        raise FormatError(f"a chain must be a JSON object, got {type(d).__name__}")
    fmt = d.get("format")
    if fmt != CHAIN_FORMAT:
        raise FormatError(
            f"not a chain file: 'format' is {fmt!r}, expected {CHAIN_FORMAT!r}",
            "produce chains with `offload profile`, or see the README for the format",
        )
    _no_unknown(d, {"format", "name", "source", "platform", "base_bytes", "stages"}, "the chain")
    name = _string(d, "name", "")
    source = d.get("source", {})
    if not isinstance(source, Mapping):
        raise FormatError("'source' must be an object")
    platform = platform_from_dict(d.get("platform"))
    base = _bytes(d, "base_bytes", "") if "base_bytes" in d else 0
    raw = d.get("stages")
    if not isinstance(raw, list) or not raw:
        raise FormatError("'stages' must be a non-empty list")
    L = len(raw)
    stages = []
    for i, s in enumerate(raw, start=1):
        ctx = f"stages[{i}]"
        if not isinstance(s, Mapping):
            raise FormatError(f"{ctx} must be an object")
        _no_unknown(s, _STAGE_KEYS, ctx)
        saved = _bytes(s, "saved_bytes", ctx)
        fwd_peak = _bytes(s, "fwd_peak_bytes", ctx)
        if fwd_peak < saved:
            raise FormatError(
                f"{ctx}.fwd_peak_bytes ({fwd_peak}) < saved_bytes ({saved}): the forward peak "
                "includes the stage's own unit"
            )
        need = s.get("need_from", i)
        if isinstance(need, bool) or not isinstance(need, int) or not i <= need <= L:
            raise FormatError(f"{ctx}.need_from must be an integer in [{i}, {L}], got {need!r}")
        stages.append(
            Stage(
                name=_string(s, "name", ctx, f"stage{i}"),
                kind=_string(s, "kind", ctx, "layer"),
                fwd_s=_number(s, "fwd_s", ctx),
                bwd_s=_number(s, "bwd_s", ctx),
                saved_bytes=saved,
                fwd_peak_bytes=fwd_peak,
                bwd_peak_bytes=_bytes(s, "bwd_peak_bytes", ctx),
                need_from=need,
                encodings=_encodings_from_list(s.get("encodings", []), saved, ctx),
            )
        )
    return Chain(name=name, stages=tuple(stages), platform=platform, base_bytes=base, source=dict(source))


def to_dict(chain: Chain) -> dict:
    """The ``chain.json`` document of ``chain`` (all defaults written out)."""
    p = chain.platform
    platform: dict[str, Any] = {
        "d2h_bytes_per_s": p.d2h_bytes_per_s,
        "h2d_bytes_per_s": p.h2d_bytes_per_s,
        "latency_s": p.latency_s,
        "channels": p.channels,
    }
    if p.note:
        platform["note"] = p.note
    return {
        "format": CHAIN_FORMAT,
        "name": chain.name,
        "source": dict(chain.source),
        "platform": platform,
        "base_bytes": chain.base_bytes,
        "stages": [_stage_to_dict(s) for s in chain.stages],
    }


def _stage_to_dict(s: Stage) -> dict:
    """One stage's object; ``encodings`` only when it has some, so that chains without
    encodings keep their hash (and files) from before encodings existed."""
    d = {
        "name": s.name,
        "kind": s.kind,
        "fwd_s": s.fwd_s,
        "bwd_s": s.bwd_s,
        "saved_bytes": s.saved_bytes,
        "fwd_peak_bytes": s.fwd_peak_bytes,
        "bwd_peak_bytes": s.bwd_peak_bytes,
        "need_from": s.need_from,
    }
    if s.encodings:
        d["encodings"] = _encodings_to_list(s.encodings)
    return d


def load_chain(path: str | os.PathLike) -> Chain:
    """Read and validate a ``chain.json``; errors name the file and the field."""
    try:
        return chain_from_dict(read_json(path, "chain"))
    except FormatError as exc:
        if str(path) in str(exc):
            raise
        raise FormatError(f"{path}: {exc}", exc.hint) from None


def save_chain(chain: Chain, path: str | os.PathLike) -> None:
    write_json(path, to_dict(chain))
