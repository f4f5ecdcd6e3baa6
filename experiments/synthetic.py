"""Synthetic chains with realistic proportions, for benchmarks and examples.

They stand in for profiled chains until ``offload profile`` exists: per-stage forward
times of 2-12 ms, backward 1.5-2.5x forward, units of 40-400 MB, transient peaks of
0.2-1.5x the unit, copies at 12-25 GB/s (PCIe 4.0-class), some units needed one stage
later than their own (a residual input).  Copy time per unit is then of the order of its
stage's compute, which is where scheduling matters.  Every number is drawn from a seeded
generator, so a (stages, seed) pair always gives the same chain.

    python -m experiments.synthetic --stages 24 --seed 0 -o chain.json
"""
from __future__ import annotations

import argparse

import numpy as np

from offload.step.chain import Chain
from offload.step.chainfile import chain_from_dict, save_chain

KINDS = ("conv", "conv", "conv", "block", "linear", "attention")


def synthetic_chain(stages: int, seed: int = 0, name: str | None = None) -> Chain:
    rng = np.random.default_rng(seed)
    bw = float(rng.uniform(12e9, 25e9))
    rows = []
    for i in range(1, stages + 1):
        fwd = float(rng.uniform(2e-3, 12e-3))
        saved = int(rng.uniform(40e6, 400e6))
        rows.append({
            "name": f"stage{i}",
            "kind": str(rng.choice(KINDS)),
            "fwd_s": round(fwd, 6),
            "bwd_s": round(fwd * float(rng.uniform(1.5, 2.5)), 6),
            "saved_bytes": saved,
            "fwd_peak_bytes": saved + int(saved * rng.uniform(0.2, 1.0)),
            "bwd_peak_bytes": int(saved * rng.uniform(0.5, 1.5)),
            "need_from": min(stages, i + 1) if rng.random() < 0.25 else i,
        })
    return chain_from_dict({
        "format": "offload-chain/2",
        "name": name or f"synthetic-{stages}-s{seed}",
        "source": {"model": "synthetic", "generator": "experiments.synthetic", "seed": seed},
        "platform": {"d2h_bytes_per_s": round(bw, -6), "h2d_bytes_per_s": round(bw * float(rng.uniform(0.9, 1.1)), -6),
                     "latency_s": 1e-5, "note": "synthetic, not measured"},
        "base_bytes": int(rng.uniform(1e9, 8e9)),
        "stages": rows,
    })


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a synthetic chain.json (seeded, realistic proportions).")
    ap.add_argument("--stages", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    save_chain(synthetic_chain(args.stages, args.seed), args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
