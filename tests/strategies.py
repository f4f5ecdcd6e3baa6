"""Hypothesis strategies: random chains (small integers, so the exact arithmetic is easy to
reason about) and budgets between the smallest feasible one and the no-offload peak."""
from __future__ import annotations

from hypothesis import strategies as st

from solver.chain import Chain, chain_from_dict
from solver.memory import no_offload_peak, smallest_feasible_budget


@st.composite
def chains(draw, min_stages: int = 1, max_stages: int = 6) -> Chain:
    L = draw(st.integers(min_stages, max_stages))
    stages = []
    for i in range(1, L + 1):
        saved = draw(st.integers(0, 100))
        stages.append({
            "fwd_s": draw(st.integers(1, 10)) / 1000,
            "bwd_s": draw(st.integers(1, 20)) / 1000,
            "saved_bytes": saved,
            "fwd_peak_bytes": saved + draw(st.integers(0, 60)),
            "bwd_peak_bytes": draw(st.integers(0, 60)),
            "need_from": draw(st.integers(i, L)) if draw(st.booleans()) else i,
            "kind": draw(st.sampled_from(["conv", "linear", "block"])),
        })
    return chain_from_dict({
        "format": "offload-chain/1",
        "name": "random",
        "platform": {
            "d2h_bytes_per_s": draw(st.sampled_from([4e3, 1e4, 3e4, 1e5])),
            "h2d_bytes_per_s": draw(st.sampled_from([4e3, 1e4, 3e4, 1e5])),
            "latency_s": draw(st.sampled_from([0.0, 1e-4])),
            "channels": draw(st.sampled_from(["duplex", "shared"])),
        },
        "base_bytes": draw(st.integers(0, 1000)),
        "stages": stages,
    })


@st.composite
def chain_and_budget(draw, min_stages: int = 1, max_stages: int = 6) -> tuple[Chain, int]:
    chain = draw(chains(min_stages, max_stages))
    lo, hi = smallest_feasible_budget(chain), no_offload_peak(chain)
    return chain, draw(st.integers(lo, hi))
