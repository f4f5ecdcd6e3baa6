"""The schedule file format, ``offload-schedule/2`` (docs/formats.md).

``/2`` adds ``recompute``, the recomputed runs (each with an optional ``option``: an
in-stage option of its one stage, and an optional ``checkpoint``: the release and prefetch
points of its offloaded checkpoint), and ``casts_kept``, the stages whose weight casts are
kept (optional: absent means none), and an offload's optional ``restore``: the forward at
whose start its held part comes back (absent: it stays on the device); ``/1`` files
(offloads and encodings only) still load.

``"turn"`` in a file means ``L``: the boundary between the last forward and the first
backward op.  A schedule whose chain hash differs from the chain it is used with is
refused (``ChainMismatch``); every action is checked against the schedule class.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from offload.errors import ChainMismatch, FormatError
from offload.io import validate as v
from offload.io.files import read_document, write_json

from .actions import Offload, Recompute, check_casts, check_choice, check_offloads, check_recompute, check_restores
from .budget import SCOPES, Budget
from .chain import Chain
from .schedule import Schedule

SCHEDULE_FORMAT = "offload-schedule/2"
OLD_FORMATS = ("offload-schedule/1",)
_KEYS = {"format", "chain", "budget_bytes", "budget_scope", "method", "solver", "predicted", "offload", "encode",
         "recompute", "casts_kept"}


def _point(value: Any, L: int, ctx: str) -> int:
    if value == "turn":
        return L
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{ctx} must be a stage number or \"turn\", got {value!r}")
    return value


def _option(run: Mapping, ctx: str) -> str:
    option = run.get("option", "")
    if not isinstance(option, str):
        raise FormatError(f"{ctx}.option must be the name of an in-stage option, got {option!r}")
    return option


def _run(r: Mapping, ctx: str, L: int) -> Recompute:
    first, last = v.whole(r, "first", ctx, 1, 2 ** 31), v.whole(r, "last", ctx, 1, 2 ** 31)
    if "checkpoint" not in r:
        return Recompute(first, last, _option(r, ctx))
    moved = v.obj(r["checkpoint"], f"{ctx}.checkpoint")
    if set(moved) != {"release", "prefetch"}:
        raise FormatError(f"{ctx}.checkpoint must have exactly 'release' and 'prefetch'")
    return Recompute(first, last, _option(r, ctx), _point(moved["release"], L, f"{ctx}.checkpoint.release"),
                     _point(moved["prefetch"], L, f"{ctx}.checkpoint.prefetch"))


def _run_document(r: Recompute, L: int) -> dict:
    doc: dict[str, Any] = {"first": r.first, "last": r.last}
    if r.option:
        doc["option"] = r.option
    if r.moves:
        doc["checkpoint"] = {"release": "turn" if r.release == L else r.release,
                             "prefetch": "turn" if r.prefetch == L else r.prefetch}
    return doc


def _check_chain(d: Mapping, chain: Chain) -> Mapping:
    ref = d.get("chain")
    if not isinstance(ref, Mapping) or not isinstance(ref.get("sha256"), str):
        raise FormatError("'chain' must be an object with 'name' and 'sha256'")
    if ref["sha256"] != chain.sha256:
        same = ref.get("name") == chain.name
        raise ChainMismatch(
            (f"this schedule was made for another version of chain {chain.name!r}" if same else
             f"this schedule was made for chain {ref.get('name')!r}, not for chain {chain.name!r}")
            + f" (sha256 {ref['sha256'][:12]}… against {chain.sha256[:12]}…)",
            "solve again for this chain: offload solve CHAIN --budget B -o schedule.json")
    return ref


def _encode(raw: Any) -> dict[int, str]:
    encode: dict[int, str] = {}
    for ctx, e in v.objects(raw, "encode", {"stage", "encoding"}):
        stage = v.whole(e, "stage", ctx, 1, 2 ** 31)
        if stage in encode:
            raise FormatError(f"{ctx}: stage {stage} is encoded twice")
        encode[stage] = v.string(e, "encoding", ctx)
    return encode


def schedule_from_dict(d: Any, chain: Chain) -> Schedule:
    """Validate a parsed ``schedule.json`` against ``chain`` (hash first, then actions)."""
    fmt = v.document_format(d, "schedule", SCHEDULE_FORMAT, OLD_FORMATS, "produce schedules with `offload solve`")
    v.no_unknown(d, _KEYS - ({"recompute", "casts_kept"} if fmt in OLD_FORMATS else set()), "the schedule")
    ref = _check_chain(d, chain)
    encode = _encode(d.get("encode", []))
    check_choice(chain, encode)
    offloads = []
    for ctx, o in v.objects(d.get("offload"), "offload", {"stage", "release", "prefetch", "restore"}):
        if not {"stage", "release", "prefetch"} <= set(o):
            raise FormatError(f"{ctx} must have 'stage', 'release' and 'prefetch' (and may have 'restore')")
        offloads.append(Offload(v.whole(o, "stage", ctx, 1, 2 ** 31), _point(o["release"], chain.L, f"{ctx}.release"),
                                _point(o["prefetch"], chain.L, f"{ctx}.prefetch"),
                                v.whole(o, "restore", ctx, 1, chain.L) if "restore" in o else 0))
    check_offloads(chain, offloads)
    runs = [_run(r, ctx, chain.L)
            for ctx, r in v.objects(d.get("recompute", []), "recompute", {"first", "last", "option", "checkpoint"})]
    check_recompute(chain, runs, offloads, encode)
    check_restores(offloads, runs, encode)
    kept = d.get("casts_kept", [])
    if not isinstance(kept, list) or len(set(map(repr, kept))) != len(kept):
        raise FormatError(f"'casts_kept' must be a list of distinct stage numbers, got {kept!r}")
    check_casts(chain, kept, runs)
    budget = None
    if d.get("budget_bytes") is not None:
        scope = d.get("budget_scope", "activations")
        if scope not in SCOPES:
            raise FormatError(f"'budget_scope' must be one of {SCOPES}, got {scope!r}")
        budget = Budget(v.nbytes(d, "budget_bytes", ""), scope)
    for key in ("solver", "predicted"):
        v.obj(d.get(key, {}), key)
    method = d.get("method", "")
    if not isinstance(method, str):
        raise FormatError(f"'method' must be a string, got {method!r}")
    return Schedule(chain_name=str(ref.get("name", "")), chain_sha256=ref["sha256"], offloads=tuple(sorted(offloads)),
                    budget=budget, method=method, solver=dict(d.get("solver", {})),
                    predicted=dict(d.get("predicted", {})), encode=encode, recompute=tuple(sorted(runs)),
                    casts_kept=tuple(sorted(kept)))


def schedule_to_dict(s: Schedule, chain: Chain) -> dict:
    """The ``schedule.json`` document; points equal to ``L`` are written as ``"turn"``."""
    L = chain.L
    doc = {
        "format": SCHEDULE_FORMAT,
        "chain": {"name": s.chain_name, "sha256": s.chain_sha256},
        "budget_bytes": s.budget.nbytes if s.budget else None,
        "budget_scope": s.budget.scope if s.budget else "activations",
        "method": s.method,
        "solver": dict(s.solver),
        "predicted": dict(s.predicted),
        "offload": [_offload_document(o, L) for o in s.offloads],
        "encode": [{"stage": i, "encoding": name} for i, name in sorted(s.encode.items())],
        "recompute": [_run_document(r, L) for r in s.recompute],
    }
    if s.casts_kept:  # absent otherwise: a schedule that keeps none reads as before
        doc["casts_kept"] = list(s.casts_kept)
    return doc


def _offload_document(o: Offload, L: int) -> dict[str, Any]:
    d: dict[str, Any] = {"stage": o.stage, "release": "turn" if o.release == L else o.release,
                         "prefetch": "turn" if o.prefetch == L else o.prefetch}
    if o.restore:  # absent otherwise: a schedule that restores nothing reads as before
        d["restore"] = o.restore
    return d


def load_schedule(path: str | os.PathLike, chain: Chain) -> Schedule:
    """Read a ``schedule.json`` and bind it to ``chain`` (refused if made for another)."""
    return read_document(path, "schedule", lambda d: schedule_from_dict(d, chain))


def save_schedule(s: Schedule, chain: Chain, path: str | os.PathLike) -> None:
    """Write the schedule (the output rule of ``offload.io.files``)."""
    write_json(path, schedule_to_dict(s, chain))
