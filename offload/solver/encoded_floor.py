"""The smallest budget when encodings may be chosen (docs/encodings.md): a small exact MILP.

Every unit's choice of encoding changes the floor memory (every unit offloaded at once,
fetched on demand: ``offload.step.memory.floor_offloads``) of a few ops additively, so the
least peak is a min-max MILP over one binary per (unit, encoding).  With recomputation a
unit may instead be recomputed, never both (docs/model.md, "Recomputation"): one more binary
per recomputable unit, what recomputing it relieves (``memory.relieve``) as its change, and the MILP's optimum is a
lower bound on the joint class's smallest budget (the relief is one).
"""
from __future__ import annotations

import numpy as np
import pulp

from offload.step.chain import Chain
from offload.step.encoding import allowed, apply
from offload.step.memory import floor_bound_memory, floor_offloads, op_memory, relieve

from .pulp_backend import run

_floor_cache: dict[tuple[str, str, bool], tuple[np.ndarray, dict[int, str]]] = {}


def floor(chain: Chain, mode: str = "lossless", recompute: bool = False) -> tuple[int, dict[int, str]]:
    """Smallest activation budget any schedule meets when encodings of ``mode`` may be
    chosen, and a choice that meets it (with every unit offloaded at once, fetched on demand);
    with ``recompute``, a lower bound on it for the joint class and the encodings of the
    choice that gives it (``floor_by_op``)."""
    memory, choice = floor_by_op(chain, mode, recompute)
    return int(memory.max()), choice


def floor_by_op(chain: Chain, mode: str = "lossless", recompute: bool = False) -> tuple[np.ndarray, dict[int, str]]:
    """Per op, what the floor holds (module doc), at the choice of encodings (and, with
    ``recompute``, of recomputed units) whose largest op is least, and that choice's encodings.

    Every unit's choice changes the floor memory of a few ops additively, so the least peak
    is a small min-max MILP over one binary per (unit, encoding or recomputation), at most
    one per unit; it is solved exactly."""
    opts = allowed(chain, mode)
    plain = floor_bound_memory(chain, recompute)
    if not opts:
        return plain, {}
    key = (chain.sha256, mode, recompute)
    if key not in _floor_cache:
        _floor_cache[key] = _least(chain, opts, plain, recompute)
    memory, choice = _floor_cache[key]
    return memory.copy(), dict(choice)


def _least(chain: Chain, opts: dict, plain: np.ndarray, recompute: bool) -> tuple[np.ndarray, dict[int, str]]:
    base = op_memory(chain, floor_offloads(chain))
    deltas: dict[tuple[int, str | None], np.ndarray] = {}
    for i, es in opts.items():
        for e in es:
            derived = apply(chain, {i: e.name})
            deltas[i, e.name] = op_memory(derived, floor_offloads(derived)) - base
    for i in chain.recomputable if recompute else ():
        deltas[i, None] = np.zeros_like(base)  # recomputed (None), not encoded
        relieve(chain, deltas[i, None], [i])
    scale = max(float(base.max()), 1.0)
    lp = pulp.LpProblem("encoded_floor", pulp.LpMinimize)
    peak = lp.add_variable("peak")
    pick = {k: lp.add_variable(f"c{n}", cat=pulp.LpBinary) for n, k in enumerate(deltas)}
    for i in {i for i, _ in deltas}:
        lp += pulp.lpSum(v for (j, _), v in pick.items() if j == i) <= 1
    lp += peak
    for o in range(len(base)):
        terms = [float(deltas[k][o]) / scale * v for k, v in pick.items() if deltas[k][o] != 0]
        lp += peak >= float(base[o]) / scale + pulp.lpSum(terms)
    out = run(lp, "highs", time_limit=30.0, gap=0.0, threads=1)
    chosen = [k for k, v in pick.items() if out.has_solution and (v.varValue or 0) > 0.5]
    choice = {i: name for i, name in chosen if name is not None}
    derived = apply(chain, choice)
    memory = op_memory(derived, floor_offloads(derived))
    relieve(chain, memory, [i for i, name in chosen if name is None])
    return (memory, choice) if memory.max() < plain.max() else (plain, {})
