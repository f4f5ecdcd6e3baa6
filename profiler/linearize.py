"""Cut a captured model into a chain of stages.

Every cut candidate splits the model in two (see ``capture``); the finest chain cuts at all
of them.  By default a stage without parameters (a ReLU after a residual add, a pooling, a
flatten) is merged into the stage before it, so that a residual or dense block is one
stage and a conv is not separated from its activation.  ``merge_to`` then groups stages to
a target count, balancing a per-stage weight (the measured time, when re-profiling).
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Sequence

import networkx as nx
import numpy as np
from torch import nn

from solver.fileio import write_atomic

from .capture import SINK, SOURCE, Capture
from .staged import StagedModel, StageInfo


def segments(cap: Capture, cuts: Sequence[str]) -> list[list[str]]:
    """The ops of each stage: stage ``k`` ends with ``cuts[k-1]`` (the last stage with the output)."""
    pos = {name: i for i, name in enumerate(cap.order)}
    ends = [pos[c] for c in cuts] + [len(cap.order) - 1]
    out, start = [], 0
    for end in ends:
        out.append(cap.order[start:end + 1])
        start = end + 1
    return out


def default_cuts(cap: Capture) -> list[str]:
    """All candidates, less those that would leave a stage without parameters."""
    fine = segments(cap, cap.candidates)
    has_params = [any(cap.graph.nodes[op]["has_params"] for op in seg) for seg in fine]
    cuts = []
    for k, cut in enumerate(cap.candidates):
        # cut k ends fine stage k; keep it when the stages on both sides hold parameters
        # (a parameter-free stage joins its predecessor; a parameter-free first stage its successor)
        if has_params[k + 1] and (has_params[k] or any(has_params[:k])):
            cuts.append(cut)
    return cuts


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
    # best[j] = minimal max-group-weight for the first j stages in g groups
    best = prefix.copy()
    best[0] = 0.0
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


def _labels(cap: Capture, ops: list[str]) -> list[str]:
    """The labels that name a stage: its parameterized ops', or all of them if it has none."""
    g = cap.graph.nodes
    return [g[op]["label"] for op in ops if g[op]["has_params"]] or [g[op]["label"] for op in ops]


def _common_name(labels: list[str]) -> tuple[str, list[str]]:
    """(shared dotted prefix, first differing component of each label)."""
    parts = [lab.split(".") for lab in labels]
    prefix = os.path.commonprefix(parts)
    rest = [p[len(prefix)] for p in parts if len(p) > len(prefix)]
    return ".".join(prefix), rest


def _stage_name(labels: list[str], detailed: bool) -> str:
    prefix, rest = _common_name(labels)
    if rest and (detailed or not prefix):
        span = rest[0] if rest[0] == rest[-1] else f"{rest[0]}..{rest[-1]}"
        return f"{prefix}.{span}" if prefix else span
    return prefix or labels[0]


def _stage_kind(cap: Capture, ops: list[str]) -> str:
    g = cap.graph.nodes
    param_kinds = [g[op]["kind"] for op in ops if g[op]["has_params"]]
    if any(g[op]["kind"] == "attention" for op in ops):
        return "attention"
    if len(set(param_kinds)) == 1:
        return param_kinds[0]
    if param_kinds:
        return "conv-block" if "conv" in param_kinds else "block"
    return Counter(g[op]["kind"] for op in ops).most_common(1)[0][0] if ops else "op"


def stage_infos(cap: Capture, segs: list[list[str]]) -> list[StageInfo]:
    """Name and kind each stage.  Names are unique, so a chain matches its model stage by stage:
    where a short name (the shared module prefix) repeats, the span of submodules is added."""
    labels = [_labels(cap, seg) for seg in segs]
    short = [_stage_name(lab, detailed=False) for lab in labels]
    repeated = {n for n, c in Counter(short).items() if c > 1}
    names = [_stage_name(lab, detailed=True) if n in repeated else n for n, lab in zip(short, labels)]
    seen: Counter[str] = Counter()
    infos = []
    for name, seg in zip(names, segs):
        seen[name] += 1
        infos.append(StageInfo(name=name if seen[name] == 1 else f"{name}#{seen[name]}", kind=_stage_kind(cap, seg),
                               ops=list(seg), has_params=any(cap.graph.nodes[op]["has_params"] for op in seg)))
    return infos


def stage_model(cap: Capture, cuts: Sequence[str]) -> StagedModel:
    """Instrument the model with boundaries at ``cuts`` (a subsequence of the candidates)."""
    unknown = [c for c in cuts if c not in cap.candidates]
    if unknown:
        raise ValueError(f"not cut candidates: {unknown}")
    segs = segments(cap, cuts)
    stages = stage_infos(cap, segs)
    graph = cap.graph.copy()
    for k, seg in enumerate(segs, start=1):
        for op in seg:
            graph.nodes[op]["stage"] = k
    for op in cuts:
        graph.nodes[op]["cut"] = True
    module: nn.Module = cap.instrument(cuts)
    return StagedModel(module=module, stages=stages, graph=graph, capture=cap.method, cuts=list(cuts),
                       notes=list(cap.notes))


def write_op_graphml(staged: StagedModel, path: str | os.PathLike) -> None:
    """The op graph with each op's stage, for Gephi/yEd/networkx (SOURCE/SINK included)."""
    g = nx.DiGraph()
    for n, data in staged.graph.nodes(data=True):
        attrs = {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool))}
        if n in (SOURCE, SINK):
            attrs.update(label=n, kind=n.strip("_"))
        g.add_node(n, **attrs)
    g.add_edges_from(staged.graph.edges)
    write_atomic(path, lambda fh: nx.write_graphml(g, fh), binary=True)
