"""The smallest budget when encodings may be chosen (docs/encodings.md): a small exact MILP.

Every unit's choice of encoding changes the floor memory (every unit offloaded at once,
fetched on demand: ``offload.step.memory.floor_offloads``) of a few ops additively, so the
least peak is a min-max MILP over one binary per (unit, encoding).
"""
from __future__ import annotations

import pulp

from offload.step.chain import Chain
from offload.step.encoding import allowed, apply
from offload.step.memory import floor_offloads, op_memory

from .pulp_backend import run

_floor_cache: dict[tuple[str, str], tuple[int, dict[int, str]]] = {}


def floor(chain: Chain, mode: str = "lossless") -> tuple[int, dict[int, str]]:
    """Smallest activation budget any schedule meets when encodings of ``mode`` may be
    chosen, and a choice that meets it (with every unit offloaded at once, fetched on demand).

    Every unit's choice changes the floor memory of a few ops additively, so the least peak
    is a small min-max MILP over one binary per (unit, encoding); it is solved exactly."""
    opts = allowed(chain, mode)
    plain = int(op_memory(chain, floor_offloads(chain)).max())
    if not opts:
        return plain, {}
    key = (chain.sha256, mode)
    if key in _floor_cache:
        return _floor_cache[key]
    base = op_memory(chain, floor_offloads(chain)).astype(float)
    scale = max(float(base.max()), 1.0)
    lp = pulp.LpProblem("encoded_floor", pulp.LpMinimize)
    peak = lp.add_variable("peak")
    deltas = {}
    pick = {}
    for i, es in opts.items():
        for n, e in enumerate(es):
            derived = apply(chain, {i: e.name})
            deltas[i, e.name] = op_memory(derived, floor_offloads(derived)).astype(float) - base
            pick[i, e.name] = lp.add_variable(f"c{i}_{n}", cat=pulp.LpBinary)
        lp += pulp.lpSum(pick[i, e.name] for e in es) <= 1
    lp += peak
    for o in range(len(base)):
        terms = [deltas[k][o] / scale * v for k, v in pick.items() if deltas[k][o] != 0]
        lp += peak >= base[o] / scale + pulp.lpSum(terms)
    out = run(lp, "highs", time_limit=30.0, gap=0.0, threads=1)
    choice = {i: name for (i, name), v in pick.items() if out.has_solution and (v.varValue or 0) > 0.5}
    derived = apply(chain, choice)
    value = int(op_memory(derived, floor_offloads(derived)).max())
    result = (value, choice) if value < plain else (plain, {})
    _floor_cache[key] = result
    return result
