"""Reading the chain file format, ``offload-chain/2`` (docs/formats.md): validation and I/O.

Files are validated field by field on load (``validate``), so a malformed chain is refused
with a message naming the field, never half-used.  A chain writes its own document (``Chain.document``), whose hash is its
identity; the hash covers everything but
``source`` (provenance), the recipe included: a schedule binds to one chain and one way of
rebuilding its model.  ``offload-chain/1`` files still load (their ``platform.channels`` is
ignored: the model takes the two directions to copy at once); they carry no recipe,
so they can be solved but not trained with.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from typing import Any, Mapping

from offload.errors import FormatError
from offload.io import validate as v
from offload.io.files import read_document, write_json

from .chain import CHAIN_FORMAT, RECORDED_TIMES, Chain, EncodedTensor, Encoding, Platform, Recipe, Stage, StageOption
from .names import AUTOCAST, COMPILE_BACKENDS, DTYPES, ENCODERS, OPTIMIZERS, WHOLE_GRAPH_BACKENDS

OLD_FORMATS = ("offload-chain/1",)
MAX_TOTAL_BYTES = 2 ** 62  # sums of per-op memory stay exact in int64
_SITE = re.compile(r"[^@\[\]]*(@\d+)?(:in)?(\[\d+\])?")  # offload.core.staging.Site.text
_KEYS = {"format", "name", "source", "platform", "base_bytes", "workspace_bytes", "stages", "recipe"}
_STAGE_KEYS = {"name", "kind", "fwd_s", "bwd_s", "saved_bytes", "fwd_peak_bytes", "bwd_peak_bytes", "need_from", "encodings",
               "held_bytes", "held_until", "input_bytes", "recomputable", "rerun_output",
               "carry_bytes", "bwd_start_bytes", "recomputed_fwd_peak_bytes", "rerun_peak_bytes", "rebuilt_bytes",
               "input_carried_bytes", "input_held_bytes", "rerun_held_bytes", "fwd_host_s", "bwd_host_s", "cast_bytes", "recast_s",
               "options", "recording_host_s", "rerun_host_s", "input_own_bytes", "input_prev_bytes", "input_prev_held_bytes", "shared_saves",
               "dropped_saves", "held_saves", "held_read_at", "storages", "saves", "moved_bytes",
               "carried_early_bytes", "carried_late_bytes", "input_late_bytes", "held_late_bytes", "input_held_late_bytes", "fwd_start_bytes",
               *RECORDED_TIMES}
_ENCODING_KEYS = {"name", "lossless", "encode_s", "decode_s", "tensors", "fwd_held_bytes", "next_held_bytes",
                  "bwd_held_bytes"}
_TENSOR_KEYS = {"index", "encoder", "bytes", "encoded_bytes", "output", "workspace_bytes"}
_PLATFORM_KEYS = {"d2h_bytes_per_s", "h2d_bytes_per_s", "latency_s", "note", "copy_host_s", "handle_host_s",
                  "copy_device_s", "handle_device_s"}
_RECIPE_KEYS = {"model", "batch", "options", "dtype", "seed", "optimizer", "cuts", "inputs", "autocast", "set_to_none",
                "cache_off", "casts_cleared", "casts_uncached", "compile", "whole_graph"}
_INPUT = re.compile(r"[^:=]+:[a-z0-9]+\[[0-9,]*\]|[^:=]+=.+")  # a tensor's name:dtype[shape], a plain name=value


def _indices(raw: Any, ctx: str) -> tuple[int, ...]:
    """A stage's list of storage indices (``shared_saves``, ``dropped_saves``, ``held_saves``): distinct, in
    increasing order."""
    if not isinstance(raw, list):
        raise FormatError(f"{ctx} must be a list of storage indices")
    items = {str(j): x for j, x in enumerate(raw)}  # each element validated under its position
    out = tuple(v.whole(items, str(j), ctx, 0, 2 ** 31) for j in range(len(raw)))
    if list(out) != sorted(set(out)):
        raise FormatError(f"{ctx} must hold distinct indices in increasing order, got {list(out)}")
    return out


def _held_read_at(s: Mapping, ctx: str, i: int, L: int, held: int, until: int) -> tuple[tuple[int, ...], int]:
    """A stage's ``held_saves`` and ``held_read_at``, together or neither: a forward after the
    next that the held part lives to (at most the one after ``held_until``)."""
    if ("held_saves" in s) != ("held_read_at" in s):
        raise FormatError(f"{ctx}: held_saves and held_read_at go together (the held storages and their next reader)")
    if "held_read_at" not in s:
        return (), 0
    if not held:
        raise FormatError(f"{ctx}.held_read_at needs held_bytes: only a held part is read again by a later forward")
    at = v.whole(s, "held_read_at", ctx, i + 2, min(until + 1, L))
    saves = _indices(s["held_saves"], f"{ctx}.held_saves")
    if not saves:
        raise FormatError(f"{ctx}.held_saves must name the held storages (none given)")
    return saves, at


def _encodings(raw: Any, saved: int, reads: int, ctx: str) -> tuple[Encoding, ...]:
    """A stage's ``encodings``: names unique, encoders known, sizes consistent with the unit, an
    op memory measured for each of its ``reads`` backward ops where one is."""
    out, names = [], set()
    for ectx, e in v.objects(raw, f"{ctx}.encodings", _ENCODING_KEYS):
        name = v.string(e, "name", ectx)
        if name in names:
            raise FormatError(f"{ectx}.name {name!r} is used twice in this stage")
        names.add(name)
        if not isinstance(e.get("tensors"), list) or not e["tensors"]:
            raise FormatError(f"{ectx}.tensors must be a non-empty list")
        tensors, seen = [], set()
        for tctx, t in v.objects(e["tensors"], f"{ectx}.tensors", _TENSOR_KEYS):
            index = v.whole(t, "index", tctx, 0, 2 ** 31)
            if index in seen:
                raise FormatError(f"{tctx}.index {index} is used twice")
            seen.add(index)
            encoder = v.string(t, "encoder", tctx)
            if encoder not in ENCODERS:
                raise FormatError(f"{tctx}.encoder {encoder!r} is unknown", f"known encoders: {', '.join(ENCODERS)}")
            raw_bytes, coded = v.nbytes(t, "bytes", tctx), v.nbytes(t, "encoded_bytes", tctx)
            if coded > 2 * raw_bytes + 64:
                raise FormatError(f"{tctx}.encoded_bytes ({coded}) is far above its bytes ({raw_bytes}): no encoder grows "
                                  "a storage that much")
            tensors.append(EncodedTensor(index, encoder, raw_bytes, coded, v.flag(t, "output", tctx, False),
                                         v.nbytes(t, "workspace_bytes", tctx) if "workspace_bytes" in t else 0))
        enc = Encoding(name, v.flag(e, "lossless", ectx, False), v.seconds(e, "encode_s", ectx),
                       v.seconds(e, "decode_s", ectx), tuple(tensors))
        if enc.covered_bytes > saved:
            raise FormatError(f"{ectx} covers {enc.covered_bytes} bytes, more than the unit's saved_bytes ({saved})")
        out.append(_measured(e, enc, reads, ectx))
    return tuple(out)


def _measured(e: Mapping, enc: Encoding, reads: int, ctx: str) -> Encoding:
    """``enc`` with the op memory measured with it on, where given: an op frees at most the
    raw bytes the encoding covers; one value per backward op from ``Bi`` to ``B(need_from)``."""
    low = -enc.covered_bytes
    fwd = v.whole(e, "fwd_held_bytes", ctx, low) if "fwd_held_bytes" in e else None
    nxt = v.whole(e, "next_held_bytes", ctx, low) if "next_held_bytes" in e else None
    bwd = None
    if "bwd_held_bytes" in e:
        raw = e["bwd_held_bytes"]
        if not isinstance(raw, list) or len(raw) != reads:
            raise FormatError(f"{ctx}.bwd_held_bytes must list one value per backward op from this stage's to its "
                              f"need_from's ({reads}), got {raw!r}")
        items = {str(k): b for k, b in enumerate(raw)}  # each element validated under its position, as _indices does
        bwd = tuple(v.whole(items, str(k), f"{ctx}.bwd_held_bytes", low) for k in range(len(raw)))
    return replace(enc, fwd_held_bytes=fwd, next_held_bytes=nxt, bwd_held_bytes=bwd)


def _recorded(s: Mapping, ctx: str, fwd_s: float, bwd_s: float) -> tuple[float | None, float | None, float | None]:
    """A stage's ``recorded_fwd_s``, ``rerun_s`` and ``recorded_bwd_s``, where given: the
    recorded ops at least the plain ones (the solver's bounds take ``fwd_s`` and ``bwd_s`` as
    each op's shortest)."""
    forward, backward = (v.seconds(s, key, ctx) if key in s else None for key in ("recorded_fwd_s", "recorded_bwd_s"))
    for key, t, plain in (("fwd_s", forward, fwd_s), ("bwd_s", backward, bwd_s)):
        if t is not None and t < plain:
            raise FormatError(f"{ctx}.recorded_{key} ({t}) < {key} ({plain}): a stage recorded for a re-run is charged "
                              "at least the ops the chain timed")
    return forward, v.seconds(s, "rerun_s", ctx) if "rerun_s" in s else None, backward


def _options(raw: Any, saved: int, stage: Stage, ctx: str) -> tuple[StageOption, ...]:
    """A stage's in-stage ``options``: names unique, each keeping part of the unit, re-running
    at most what the stage's re-run does and recording at least what its recorded forward does."""
    rerun, recorded = stage.rerun, stage.recorded_fwd
    rerun_key = "rerun_s" if stage.rerun_s is not None else "fwd_s"
    recorded_key = "recorded_fwd_s" if stage.recorded_fwd_s is not None else "fwd_s"
    out, names = [], set()
    for octx, o in v.objects(raw, f"{ctx}.options", {"name", "kept_bytes", "recompute_s", "fwd_peak_bytes",
                                                     "rerun_peak_bytes", "fwd_s", "kept_storages"}):
        name = v.string(o, "name", octx)
        if name in names:
            raise FormatError(f"{octx}.name {name!r} is used twice in this stage")
        names.add(name)
        kept, again = v.whole(o, "kept_bytes", octx, 0, saved), v.seconds(o, "recompute_s", octx)
        if again > rerun:
            raise FormatError(f"{octx}.recompute_s ({again}) > the stage's {rerun_key} ({rerun}): an option re-runs "
                              "part of the forward")
        peaks = [v.whole(o, key, octx, 0, 2 ** 53) if key in o else None for key in ("fwd_peak_bytes", "rerun_peak_bytes")]
        forward = v.seconds(o, "fwd_s", octx) if "fwd_s" in o else None
        if forward is not None and forward < recorded:
            raise FormatError(f"{octx}.fwd_s ({forward}) < the stage's {recorded_key} ({recorded}): recording what an "
                              "option keeps adds to the forward")
        out.append(StageOption(name, kept, again, *peaks, forward,
                               kept_storages=v.whole(o, "kept_storages", octx, 0, kept) if "kept_storages" in o else 0))
    return tuple(out)


def platform_from_dict(d: Any, legacy: bool = False) -> Platform:
    """Validate a ``platform`` object (``legacy``: a ``/1`` file, whose ``channels`` is ignored)."""
    d = v.obj(d, "platform")
    v.no_unknown(d, _PLATFORM_KEYS | ({"channels"} if legacy else set()), "platform")
    note = d.get("note", "")
    if not isinstance(note, str):
        raise FormatError("'platform.note' must be a string")
    return Platform(d2h_bytes_per_s=v.bandwidth(d, "d2h_bytes_per_s", "platform"),
                    h2d_bytes_per_s=v.bandwidth(d, "h2d_bytes_per_s", "platform"),
                    latency_s=v.seconds(d, "latency_s", "platform") if "latency_s" in d else 0.0, note=note,
                    copy_host_s=v.seconds(d, "copy_host_s", "platform") if "copy_host_s" in d else 0.0,
                    handle_host_s=v.seconds(d, "handle_host_s", "platform") if "handle_host_s" in d else 0.0,
                    copy_device_s=v.seconds(d, "copy_device_s", "platform") if "copy_device_s" in d else 0.0,
                    handle_device_s=v.seconds(d, "handle_device_s", "platform") if "handle_device_s" in d else 0.0)


def recipe_from_dict(d: Any) -> Recipe:
    """Validate a ``recipe`` object."""
    d = v.obj(d, "recipe")
    v.no_unknown(d, _RECIPE_KEYS, "recipe")
    options = v.obj(d.get("options", {}), "recipe.options")
    for key, value in options.items():
        if not isinstance(value, (int, float, str)):  # bool is an int
            raise FormatError(f"'recipe.options.{key}' must be a number, a string or a boolean, got {value!r}")
    return Recipe(model=v.string(d, "model", "recipe"), batch=v.whole(d, "batch", "recipe", 1, 2 ** 31),
                  options=dict(options), dtype=v.choice(d, "dtype", "recipe", DTYPES, "float32"),
                  seed=v.whole(d, "seed", "recipe", 0, 2 ** 63) if "seed" in d else 0,
                  optimizer=v.choice(d, "optimizer", "recipe", OPTIMIZERS, "adam"),
                  cuts=v.matching(d, "cuts", "recipe", _SITE, "call sites (module path, optional @call, :in and [value])"),
                  inputs=v.matching(d, "inputs", "recipe", _INPUT, "input signatures (name:dtype[shape] or name=value)"),
                  autocast=v.choice(d, "autocast", "recipe", AUTOCAST),
                  set_to_none=v.flag(d, "set_to_none", "recipe", False),
                  cache_off=v.flag(d, "cache_off", "recipe", False),
                  casts_cleared=v.flag(d, "casts_cleared", "recipe", False),
                  casts_uncached=v.flag(d, "casts_uncached", "recipe", False),
                  compile=v.choice(d, "compile", "recipe", COMPILE_BACKENDS),
                  whole_graph=_whole_graph(d))


def _whole_graph(d: Mapping) -> bool:
    whole = v.flag(d, "whole_graph", "recipe", False)
    if whole and d.get("compile") not in WHOLE_GRAPH_BACKENDS:
        raise FormatError(f"'recipe.whole_graph' needs 'recipe.compile' {' or '.join(WHOLE_GRAPH_BACKENDS)} (the "
                          "backend that compiled the one graph)")
    return whole


def _stage(s: Any, i: int, L: int, before: Stage | None) -> Stage:
    ctx = f"stages[{i}]"
    if not isinstance(s, Mapping):
        raise FormatError(f"{ctx} must be an object")
    v.no_unknown(s, _STAGE_KEYS, ctx)
    saved = v.nbytes(s, "saved_bytes", ctx)
    fwd_peak = v.nbytes(s, "fwd_peak_bytes", ctx)
    if fwd_peak < saved:
        raise FormatError(f"{ctx}.fwd_peak_bytes ({fwd_peak}) < saved_bytes ({saved}): the forward peak "
                          "includes the stage's own unit")
    need = v.whole(s, "need_from", ctx, i, L) if "need_from" in s else i
    held = v.whole(s, "held_bytes", ctx, 0, saved) if "held_bytes" in s else 0
    until = v.whole(s, "held_until", ctx, min(i + 2, L), L) if held else 0
    bwd_peak = v.nbytes(s, "bwd_peak_bytes", ctx)
    checkpoint = v.nbytes(s, "input_bytes", ctx) if "input_bytes" in s else 0
    carry = v.whole(s, "carry_bytes", ctx, 0, saved) if "carry_bytes" in s else None
    fwd_s, bwd_s = v.seconds(s, "fwd_s", ctx), v.seconds(s, "bwd_s", ctx)
    recorded_fwd, rerun, recorded_bwd = _recorded(s, ctx, fwd_s, bwd_s)
    recast = v.seconds(s, "recast_s", ctx) if "recast_s" in s else 0.0
    if recast > bwd_s:
        raise FormatError(f"{ctx}.recast_s ({recast}) > bwd_s ({bwd_s}): the backward's time includes its recasts")
    carried = v.whole(s, "input_carried_bytes", ctx, 0, min(checkpoint, saved if carry is None else carry)) \
        if "input_carried_bytes" in s else 0
    late = v.whole(s, "carried_late_bytes", ctx, 0, max(0, (saved if carry is None else carry) - held)) \
        if "carried_late_bytes" in s else 0
    held_late = v.whole(s, "held_late_bytes", ctx, 0, held) if "held_late_bytes" in s else 0
    input_held = v.whole(s, "input_held_bytes", ctx, 0, min(carried, held)) if "input_held_bytes" in s else 0
    shared = _indices(s["shared_saves"], f"{ctx}.shared_saves") if "shared_saves" in s else ()
    dropped = _indices(s["dropped_saves"], f"{ctx}.dropped_saves") if "dropped_saves" in s else ()
    held_saves, read_at = _held_read_at(s, ctx, i, L, held, until)
    prev = v.whole(s, "input_prev_bytes", ctx, 0, min(before.saved_bytes if before is not None else 0, checkpoint - carried)) \
        if "input_prev_bytes" in s else 0
    encodings = _encodings(s.get("encodings", []), saved, need - i + 1, ctx)
    staying = set(shared) | set(dropped)
    for what, a, b in (("in shared_saves and in dropped_saves", shared, dropped),
                       ("encoded and in shared_saves or dropped_saves", {t.index for e in encodings for t in e.tensors},
                        staying),
                       ("in held_saves and in shared_saves or dropped_saves", held_saves, staying)):
        both = sorted(set(a) & set(b))
        if both:
            raise FormatError(f"{ctx}: storage #{both[0]} is {what} (those stay on the device, in no unit, for one "
                              "reason each)")
    stage = Stage(name=v.string(s, "name", ctx, f"stage{i}"), kind=v.string(s, "kind", ctx, "layer"),
                  fwd_s=fwd_s, bwd_s=bwd_s, saved_bytes=saved,
                  fwd_peak_bytes=fwd_peak, bwd_peak_bytes=bwd_peak, need_from=need,
                  encodings=encodings, held_bytes=held, held_until=until, shared_saves=shared,
                  dropped_saves=dropped,
                  held_saves=held_saves, held_read_at=read_at,
                  recorded_fwd_s=recorded_fwd, rerun_s=rerun, recorded_bwd_s=recorded_bwd,
                  input_bytes=checkpoint,
                  recomputable=v.flag(s, "recomputable", ctx, True), rerun_output=v.flag(s, "rerun_output", ctx, True),
                  carry_bytes=carry, input_carried_bytes=carried, carried_late_bytes=late,
                  carried_early_bytes=(v.whole(s, "carried_early_bytes", ctx, 0, saved - carry)
                                       if "carried_early_bytes" in s and carry is not None else 0),
                  input_late_bytes=v.whole(s, "input_late_bytes", ctx, 0, min(carried, late)) if "input_late_bytes" in s else 0,
                  held_late_bytes=held_late,
                  input_held_late_bytes=(v.whole(s, "input_held_late_bytes", ctx, 0, min(input_held, held_late))
                                         if "input_held_late_bytes" in s else 0),
                  fwd_start_bytes=v.whole(s, "fwd_start_bytes", ctx, 0, fwd_peak) if "fwd_start_bytes" in s else 0,
                  input_held_bytes=input_held,
                  rerun_held_bytes=v.whole(s, "rerun_held_bytes", ctx, 0, checkpoint) if "rerun_held_bytes" in s else 0,
                  input_own_bytes=v.whole(s, "input_own_bytes", ctx, 0, checkpoint) if "input_own_bytes" in s else 0,
                  input_prev_bytes=prev,
                  input_prev_held_bytes=(v.whole(s, "input_prev_held_bytes", ctx, 0, min(prev, before.held_bytes))
                                         if "input_prev_held_bytes" in s and before is not None else 0),
                  bwd_start_bytes=v.whole(s, "bwd_start_bytes", ctx, 0, bwd_peak) if "bwd_start_bytes" in s else 0,
                  recomputed_fwd_peak_bytes=(v.whole(s, "recomputed_fwd_peak_bytes", ctx, 0, fwd_peak + checkpoint)
                                             if "recomputed_fwd_peak_bytes" in s else None),
                  rerun_peak_bytes=v.nbytes(s, "rerun_peak_bytes", ctx) if "rerun_peak_bytes" in s else None,
                  rebuilt_bytes=v.whole(s, "rebuilt_bytes", ctx, 0, saved) if "rebuilt_bytes" in s else None,
                  fwd_host_s=v.seconds(s, "fwd_host_s", ctx) if "fwd_host_s" in s else 0.0,
                  bwd_host_s=v.seconds(s, "bwd_host_s", ctx) if "bwd_host_s" in s else 0.0,
                  recording_host_s=v.seconds(s, "recording_host_s", ctx) if "recording_host_s" in s else 0.0,
                  rerun_host_s=v.seconds(s, "rerun_host_s", ctx) if "rerun_host_s" in s else 0.0,
                  storages=v.whole(s, "storages", ctx, 0, saved) if "storages" in s else 0,
                  saves=v.whole(s, "saves", ctx) if "saves" in s else 0,
                  moved_bytes=v.whole(s, "moved_bytes", ctx, min(1, saved), saved) if "moved_bytes" in s else None,
                  cast_bytes=v.nbytes(s, "cast_bytes", ctx) if "cast_bytes" in s else 0, recast_s=recast)
    return replace(stage, options=_options(s.get("options", []), saved, stage, ctx))  # (they read its re-run's times)


def chain_from_dict(d: Any) -> Chain:
    """Validate a parsed ``chain.json`` document and build the ``Chain``."""
    fmt = v.document_format(d, "chain", CHAIN_FORMAT, OLD_FORMATS,
                             "produce chains with `offload profile`, or see docs/formats.md")
    v.no_unknown(d, _KEYS, "the chain")
    source = v.obj(d.get("source", {}), "source")
    raw = d.get("stages")
    if not isinstance(raw, list) or not raw:
        raise FormatError("'stages' must be a non-empty list")
    stages: list[Stage] = []
    for i, s in enumerate(raw, start=1):  # a stage's input_prev_bytes is part of the unit before
        stages.append(_stage(s, i, len(raw), stages[-1] if stages else None))
    base = v.nbytes(d, "base_bytes", "") if "base_bytes" in d else 0
    workspace = v.whole(d, "workspace_bytes", "", 0, base) if "workspace_bytes" in d else 0
    total = base + sum(s.saved_bytes + s.fwd_peak_bytes + s.bwd_peak_bytes + s.input_bytes + s.cast_bytes
                       + sum(e.covered_bytes + e.encoded_bytes + e.workspace_bytes for e in s.encodings)
                       for s in stages)
    if total > MAX_TOTAL_BYTES:
        raise FormatError(f"the chain's byte counts add up to {total}, more than {MAX_TOTAL_BYTES}",
                          "byte counts are bytes, not bits or elements: check the units")
    return Chain(name=v.string(d, "name", ""), stages=tuple(stages),
                 platform=platform_from_dict(d.get("platform"), legacy=fmt in OLD_FORMATS), base_bytes=base,
                 source=dict(source), recipe=recipe_from_dict(d["recipe"]) if d.get("recipe") is not None else None,
                 workspace_bytes=workspace)


def make_chain(name: str, stages: list[Stage], platform: Platform, base_bytes: int = 0,
               source: Mapping[str, Any] | None = None, recipe: Recipe | None = None,
               workspace_bytes: int = 0) -> Chain:
    """A chain built in code (profiler, generators), validated as if it were read from a file."""
    chain = Chain(name, tuple(stages), platform, base_bytes, dict(source or {}), recipe, workspace_bytes)
    return chain_from_dict(json.loads(json.dumps(chain.document())))


def load_chain(path: str | os.PathLike) -> Chain:
    """Read and validate a ``chain.json``; errors name the file and the field."""
    return read_document(path, "chain", chain_from_dict)


def save_chain(chain: Chain, path: str | os.PathLike) -> None:
    """Write the chain (the output rule of ``offload.io.files``)."""
    write_json(path, chain.document())
