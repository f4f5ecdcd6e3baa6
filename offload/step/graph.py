"""The chain as a networkx graph: ops ``F_i``/``B_i`` and units ``U_i``.

Edges say what the schedule class must respect: ``order`` (the GPU's fixed op sequence),
``produce`` (``F_i`` creates ``U_i``) and ``need`` (``U_i`` must be resident for ``B_j``,
``j`` from ``need_from`` down to ``i``).  Exported to GraphML for inspection in any graph tool.
"""
from __future__ import annotations

import os

import networkx as nx

from offload.io.files import write_atomic

from .chain import Chain


def chain_graph(chain: Chain) -> nx.DiGraph:
    g = nx.DiGraph(name=chain.name)
    L = chain.L
    for i, st in enumerate(chain.stages, start=1):
        g.add_node(f"F{i}", type="op", phase="F", stage=i, kind=st.kind, duration_s=st.fwd_s, peak_bytes=st.fwd_peak_bytes)
        g.add_node(f"B{i}", type="op", phase="B", stage=i, kind=st.kind, duration_s=st.bwd_s, peak_bytes=st.bwd_peak_bytes)
        g.add_node(f"U{i}", type="unit", stage=i, bytes=st.saved_bytes, need_from=st.need_from,
                   offloadable=i in chain.offloadable)
    ops = [f"F{i}" for i in range(1, L + 1)] + [f"B{i}" for i in range(L, 0, -1)]
    for u, v in zip(ops, ops[1:]):
        g.add_edge(u, v, relation="order")
    for i, st in enumerate(chain.stages, start=1):
        g.add_edge(f"F{i}", f"U{i}", relation="produce")
        for j in range(st.need_from, i - 1, -1):
            g.add_edge(f"U{i}", f"B{j}", relation="need")
    return g


def write_graphml(chain: Chain, path: str | os.PathLike) -> None:
    g = chain_graph(chain)
    write_atomic(path, lambda fh: nx.write_graphml(g, fh), binary=True)
