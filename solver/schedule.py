"""Schedules and their file format, ``offload-schedule/1`` (DESIGN sections 3-4).

A schedule is, per offloaded unit ``Ui``, a release point ``r`` (``i < r <= L``: at the end
of ``Fr`` the next op waits for the D2H copy, then ``Ui`` is freed) and a prefetch point
``k`` (``need_from <= k <= L``: the H2D copy is issued at the start of ``Bk``).  ``"turn"``
in a file means ``L``: the boundary between the last forward and the first backward op.
``encode`` names, per encoded unit (kept or offloaded), the stage's encoding it uses.
A schedule names its chain by hash and is refused for any other chain.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .chain import Chain
from .errors import ChainMismatch, FormatError, ScheduleRejected
from .fileio import read_json, write_json

SCHEDULE_FORMAT = "offload-schedule/1"
Choice = Mapping[int, str]  # stage -> name of the encoding its unit uses
BUDGET_SCOPES = ("activations", "total")


@dataclass(frozen=True, order=True)
class Offload:
    """One offloaded unit: its stage, release point and prefetch point (1-based)."""

    stage: int
    release: int
    prefetch: int


@dataclass(frozen=True)
class Schedule:
    """A schedule bound to one chain (by name and sha256)."""

    chain_name: str
    chain_sha256: str
    offloads: tuple[Offload, ...]
    budget_bytes: int | None = None
    budget_scope: str = "activations"
    method: str = ""
    solver: Mapping[str, Any] = field(default_factory=dict)
    predicted: Mapping[str, Any] = field(default_factory=dict)
    encode: Mapping[int, str] = field(default_factory=dict)  # stage -> encoding name


def make_schedule(chain: Chain, offloads: Iterable[Offload], **meta: Any) -> Schedule:
    """A schedule for ``chain`` (sorted by stage), with optional metadata fields."""
    return Schedule(chain.name, chain.sha256, tuple(sorted(offloads)), **meta)


def check_offloads(chain: Chain, offloads: Iterable[Offload]) -> None:
    """Refuse actions outside the schedule class, naming the unit and the rule it breaks."""
    seen: set[int] = set()
    L = chain.L
    for o in offloads:
        i = o.stage
        if not 1 <= i <= L:
            raise ScheduleRejected(f"offload of stage {i}: the chain has stages 1..{L}")
        if i in seen:
            raise ScheduleRejected(f"stage {i} is offloaded twice")
        seen.add(i)
        if i == L:
            raise ScheduleRejected(
                f"stage {L} cannot be offloaded: its backward runs right after its forward "
                "(a release point r > i must exist)"
            )
        if not i < o.release <= L:
            raise ScheduleRejected(f"stage {i}: release point {o.release} not in [{i + 1}, {L}]")
        need = chain.stage(i).need_from
        if not need <= o.prefetch <= L:
            raise ScheduleRejected(f"stage {i}: prefetch point {o.prefetch} not in [{need}, {L}] (need_from={need})")


def check_choice(chain: Chain, choice: Choice) -> None:
    """Refuse a choice naming a stage or an encoding the chain does not have."""
    for i, name in choice.items():
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= chain.L:
            raise ScheduleRejected(f"encoding of stage {i!r}: the chain has stages 1..{chain.L}")
        try:
            chain.stage(i).encoding(name)
        except KeyError:
            offered = ", ".join(e.name for e in chain.stage(i).encodings) or "none"
            raise ScheduleRejected(f"stage {i} has no encoding {name!r} (it offers: {offered})") from None


# ------------------------------------------------------------------------ file format
def _point(v: Any, L: int, ctx: str) -> int:
    if v == "turn":
        return L
    if isinstance(v, bool) or not isinstance(v, int):
        raise FormatError(f"{ctx} must be a stage number or \"turn\", got {v!r}")
    return v


def schedule_from_dict(d: Any, chain: Chain) -> Schedule:
    """Validate a parsed ``schedule.json`` against ``chain`` (hash first, then actions)."""
    if not isinstance(d, Mapping):
        raise FormatError(f"a schedule must be a JSON object, got {type(d).__name__}")
    if d.get("format") != SCHEDULE_FORMAT:
        raise FormatError(
            f"not a schedule file: 'format' is {d.get('format')!r}, expected {SCHEDULE_FORMAT!r}",
            "produce schedules with `offload solve`",
        )
    ref = d.get("chain")
    if not isinstance(ref, Mapping) or not isinstance(ref.get("sha256"), str):
        raise FormatError("'chain' must be an object with 'name' and 'sha256'")
    if ref["sha256"] != chain.sha256:
        raise ChainMismatch(
            f"this schedule was made for chain {ref.get('name')!r} (sha256 {ref['sha256'][:12]}…), "
            f"not for chain {chain.name!r} (sha256 {chain.sha256[:12]}…)",
            "solve again for this chain: offload solve CHAIN --budget B -o schedule.json",
        )
    raw_encode = d.get("encode", [])
    if not isinstance(raw_encode, list):
        raise FormatError("'encode' must be a list of {stage, encoding}")
    encode: dict[int, str] = {}
    for n, e in enumerate(raw_encode):
        ctx = f"encode[{n}]"
        if not isinstance(e, Mapping) or set(e) != {"stage", "encoding"}:
            raise FormatError(f"{ctx} must be an object with exactly 'stage' and 'encoding'")
        if isinstance(e["stage"], bool) or not isinstance(e["stage"], int) or not isinstance(e["encoding"], str):
            raise FormatError(f"{ctx} must have an integer 'stage' and a string 'encoding'")
        if e["stage"] in encode:
            raise FormatError(f"{ctx}: stage {e['stage']} is encoded twice")
        encode[e["stage"]] = e["encoding"]
    check_choice(chain, encode)
    raw = d.get("offload")
    if not isinstance(raw, list):
        raise FormatError("'offload' must be a list of {stage, release, prefetch}")
    offloads = []
    for n, o in enumerate(raw):
        ctx = f"offload[{n}]"
        if not isinstance(o, Mapping) or set(o) != {"stage", "release", "prefetch"}:
            raise FormatError(f"{ctx} must be an object with exactly 'stage', 'release', 'prefetch'")
        stage = o["stage"]
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise FormatError(f"{ctx}.stage must be an integer, got {stage!r}")
        offloads.append(
            Offload(stage, _point(o["release"], chain.L, f"{ctx}.release"), _point(o["prefetch"], chain.L, f"{ctx}.prefetch"))
        )
    check_offloads(chain, offloads)
    budget = d.get("budget_bytes")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise FormatError(f"'budget_bytes' must be a non-negative integer or null, got {budget!r}")
    scope = d.get("budget_scope", "activations")
    if scope not in BUDGET_SCOPES:
        raise FormatError(f"'budget_scope' must be one of {BUDGET_SCOPES}, got {scope!r}")
    for key in ("solver", "predicted"):
        if not isinstance(d.get(key, {}), Mapping):
            raise FormatError(f"'{key}' must be an object")
    return Schedule(
        chain_name=str(ref.get("name", "")),
        chain_sha256=ref["sha256"],
        offloads=tuple(sorted(offloads)),
        budget_bytes=budget,
        budget_scope=scope,
        method=str(d.get("method", "")),
        solver=dict(d.get("solver", {})),
        predicted=dict(d.get("predicted", {})),
        encode=encode,
    )


def schedule_to_dict(s: Schedule, chain: Chain) -> dict:
    """The ``schedule.json`` document; points equal to ``L`` are written as ``"turn"``."""
    L = chain.L
    return {
        "format": SCHEDULE_FORMAT,
        "chain": {"name": s.chain_name, "sha256": s.chain_sha256},
        "budget_bytes": s.budget_bytes,
        "budget_scope": s.budget_scope,
        "method": s.method,
        "solver": dict(s.solver),
        "predicted": dict(s.predicted),
        "offload": [
            {
                "stage": o.stage,
                "release": "turn" if o.release == L else o.release,
                "prefetch": "turn" if o.prefetch == L else o.prefetch,
            }
            for o in s.offloads
        ],
        "encode": [{"stage": i, "encoding": name} for i, name in sorted(s.encode.items())],
    }


def load_schedule(path: str | os.PathLike, chain: Chain) -> Schedule:
    """Read a ``schedule.json`` and bind it to ``chain`` (refused if made for another)."""
    try:
        return schedule_from_dict(read_json(path, "schedule"), chain)
    except FormatError as exc:
        if str(path) in str(exc):
            raise
        raise FormatError(f"{path}: {exc}", exc.hint) from None


def save_schedule(s: Schedule, chain: Chain, path: str | os.PathLike) -> None:
    write_json(path, schedule_to_dict(s, chain))
