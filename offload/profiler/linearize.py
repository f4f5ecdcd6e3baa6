"""Cut a captured model into a chain of stages.

Every cut candidate splits the model in two (``capture``); the finest chain cuts at all of
them.  By default a stage without parameters (a ReLU after a residual add, a pooling, a
flatten) joins the stage before it, so that a residual or dense block is one stage and a
conv is not separated from its activation.  ``merge_to`` then groups stages to a target
count, balancing a per-stage weight (the measured time, when re-profiling).
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import networkx as nx
import numpy as np

from offload.core.staging import Site
from offload.io.files import write_atomic
from offload.io.text import format_bytes

from .capture import Capture


@dataclass
class StageInfo:
    """One stage of the linearized model: its name, kind, and the graph nodes it runs."""

    name: str
    kind: str
    ops: list[int]
    has_params: bool


@dataclass
class Stages:
    """A model's stages: where they end (``cuts``, one per stage but the last) and what they hold."""

    cuts: list[Site]
    stages: list[StageInfo]
    notes: list[str] = field(default_factory=list)
    crossing: dict[int, list[str]] = field(default_factory=dict)  # boundary k (after stage k) -> the values crossing it, where several do

    @property
    def L(self) -> int:
        return len(self.stages)


def segments(cap: Capture, cuts: Sequence[Site]) -> list[list[int]]:
    """The graph nodes of each stage: stage ``k`` ends with the node of ``cuts[k-1]``."""
    pos = {node: n for n, node in enumerate(cap.order)}
    ends = [pos[cap.ends[c]] for c in cuts] + [len(cap.order) - 1]
    out, start = [], 0
    for end in ends:
        out.append(cap.order[start:end + 1])
        start = end + 1
    return out


def _has_params(cap: Capture, ops: list[int]) -> bool:
    return any(cap.graph.nodes[op]["params"] for op in ops)


def default_cuts(cap: Capture) -> list[Site]:
    """All candidates, less those that would leave a stage without parameters."""
    has = [_has_params(cap, seg) for seg in segments(cap, cap.candidates)]
    # cut k ends fine stage k; keep it when the stages on both sides hold parameters
    # (a parameter-free stage joins its predecessor; a parameter-free first stage its successor)
    return [cut for k, cut in enumerate(cap.candidates) if has[k + 1] and (has[k] or any(has[:k]))]


def merge_to(weights: Sequence[float], count: int) -> list[int]:
    """Indices ``e`` such that stages ``..e`` form groups: ``count`` contiguous groups, max weight minimal.

    Returns the index of the last stage of each group but the last (0-based), by dynamic
    programming over prefix sums (vectorised over the split point).
    """
    w = np.asarray(weights, dtype=float)
    n = len(w)
    if count >= n:
        return list(range(n - 1))
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    best = prefix.copy()  # best[j]: minimal max-group-weight of the first j stages in g groups
    choice = np.zeros((count, n + 1), dtype=int)
    for g in range(1, count):
        new = np.full(n + 1, np.inf)
        for j in range(g + 1, n + 1):
            i = np.arange(g, j)  # the last group is stages i..j-1
            cost = np.maximum(best[i], prefix[j] - prefix[i])
            t = int(np.argmin(cost))
            new[j], choice[g, j] = cost[t], i[t]
        best = new
    ends, j = [], n
    for g in range(count - 1, 0, -1):
        j = choice[g, j]
        ends.append(j - 1)
    return sorted(ends)


def _labels(cap: Capture, ops: list[int]) -> list[str]:
    """The module paths that name a stage: its ops' that read weights, frozen ones too (a LoRA
    model's stage runs its frozen layer, not only the adapters that train), or all of them if
    it has none."""
    g = cap.graph.nodes
    named = [g[op]["module"] or g[op]["op"] for op in ops if g[op]["weights"]]
    return named or [g[op]["module"] or g[op]["op"] for op in ops]


def _stage_name(labels: list[str], detailed: bool) -> str:
    parts = [lab.split(".") for lab in labels]
    prefix = os.path.commonprefix(parts)
    rest = [_head(p, len(prefix)) for p in parts if len(p) > len(prefix)]
    common = ".".join(prefix)
    if rest and not common and rest[0] != rest[-1]:  # from the first item to the last: model.layers.3..lm_head
        return f"{_item(parts[0])}..{_item(parts[-1])}"
    if rest and (detailed or not common):
        span = rest[0] if rest[0] == rest[-1] else f"{rest[0]}..{rest[-1]}"
        return f"{common}.{span}" if common else span
    return common or labels[0]


def _item(path: list[str]) -> str:
    """``path`` up to its first container index (``model.layers.3``), or whole."""
    at = next((n for n, part in enumerate(path) if part.isdigit()), len(path) - 1)
    return ".".join(path[:at + 1])


def _head(path: list[str], at: int) -> str:
    """The submodule of ``path`` at depth ``at``, with its index where it is a container's
    item (``layers.0``, not ``layers``)."""
    return ".".join(path[at:at + 2]) if len(path) > at + 1 and path[at + 1].isdigit() else path[at]


def _inside(name: str, modules: set[str]) -> bool:
    """Whether any of ``modules`` is the module ``name`` or one inside it."""
    return any(m == name or m.startswith(name + ".") for m in modules)


def _stage_kind(cap: Capture, ops: list[int]) -> str:
    g = cap.graph.nodes
    param_kinds = [g[op]["kind"] for op in ops if g[op]["params"]]
    if any(g[op]["kind"] == "attention" for op in ops):
        return "attention"
    if len(set(param_kinds)) == 1:
        return param_kinds[0]
    if param_kinds:
        return "conv-block" if "conv" in param_kinds else "block"
    return Counter(g[op]["kind"] for op in ops).most_common(1)[0][0] if ops else "op"


def crossing(cap: Capture, cuts: Sequence[Site]) -> dict[int, list[str]]:
    """Per boundary that several differentiable values cross (a U-Net's skip features, an
    encoder's output, an attention bias), those values, the boundary's own first: each made
    before the boundary and read after it, described by the op and module that made it, its
    dtype and shape, and its bytes."""
    g, pos = cap.graph, {n: k for k, n in enumerate(cap.order)}
    last = {u: max((pos[v] for v in g.successors(u) if v in pos), default=-1) for u in cap.order}
    out: dict[int, list[str]] = {}
    for k, cut in enumerate(cuts, start=1):
        end = pos[cap.ends[cut]]
        values = sorted((u for u in cap.order[:end + 1] if last[u] > end), key=lambda u: (u != cap.ends[cut], pos[u]))
        if len(values) > 1:
            out[k] = [f"{g.nodes[u]['op']} in {g.nodes[u]['module'] or 'the model'} {g.nodes[u].get('value', '')} "
                      f"({format_bytes(g.nodes[u].get('bytes', 0))})" for u in values]
    return out


def stages_at(cap: Capture, cuts: Sequence[Site]) -> Stages:
    """The stages of cutting at ``cuts`` (candidates, in order), each named and kinded.  Names
    are unique, so a chain reads stage by stage: where a short name (the shared module prefix)
    repeats, or names a module another stage runs part of, the span of submodules is added."""
    unknown = [c.text for c in cuts if c not in cap.ends]
    if unknown:
        raise ValueError(f"not cut candidates: {unknown}")
    segs = segments(cap, cuts)
    labels = [_labels(cap, seg) for seg in segs]
    short = [_stage_name(lab, detailed=False) for lab in labels]
    repeated = {n for n, c in Counter(short).items() if c > 1}
    modules = [{cap.graph.nodes[op]["module"] for op in seg if cap.graph.nodes[op]["module"]} for seg in segs]
    # a stage named by a module that other stages run a part of (BART's embeddings and first
    # encoder layer: not all of ``model.encoder``) is named by the span of submodules it runs
    partial = {n for k, n in enumerate(short) if any(_inside(n, m) for j, m in enumerate(modules) if j != k)}
    names = [_stage_name(lab, detailed=True) if n in repeated | partial else n for n, lab in zip(short, labels)]
    seen: Counter[str] = Counter()
    infos = []
    for name, seg in zip(names, segs):
        seen[name] += 1
        infos.append(StageInfo(name=name if seen[name] == 1 else f"{name}#{seen[name]}", kind=_stage_kind(cap, seg),
                               ops=list(seg), has_params=_has_params(cap, seg)))
    return Stages(cuts=list(cuts), stages=infos, notes=list(cap.notes), crossing=crossing(cap, cuts))


def write_op_graphml(cap: Capture, stages: Stages, path: str | os.PathLike) -> None:
    """The activation graph with each op's stage, for Gephi/yEd/networkx."""
    g = nx.DiGraph()
    stage_of = {op: k for k, st in enumerate(stages.stages, start=1) for op in st.ops}
    for n, data in cap.graph.nodes(data=True):
        attrs = {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool))}
        if n in stage_of:
            attrs["stage"] = stage_of[n]
        g.add_node(str(n), **attrs)
    g.add_edges_from((str(a), str(b)) for a, b in cap.graph.edges)
    write_atomic(path, lambda fh: nx.write_graphml(g, fh), binary=True)
