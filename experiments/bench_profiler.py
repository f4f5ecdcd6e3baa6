"""Profiler benchmark: how long profiling takes, and how much its measured times move run to run.

Profiles one model several times in one process (default ResNet-50, batch 8, 224x224, on
this machine's default device) and prints:

* the wall time of each ``profile()`` call (capture, warm-up, memory pass, timed repeats,
  platform calibration), split into its phases;
* whether sizes (saved, transient peaks, need_from, base) are identical across runs;
* the run-to-run spread of the times: per stage, (max − min) / median over the runs of its
  forward+backward median; reported as the median and worst stage, and for the whole step.

Results go to ``experiments/results/bench_profiler.csv`` (one row per run and stage) and
the summary is printed.  ``python -m experiments.bench_profiler --help``.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

from offload.profiler.profile import ProfileOptions, profile
from offload.step.chainfile import save_chain

RESULTS = Path(__file__).parent / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default=None)
    ap.add_argument("--save-chain", metavar="PATH", help="also write the first run's chain here")
    args = ap.parse_args(argv)

    opts = ProfileOptions(batch=args.batch, device=args.device, repeats=args.repeats, options={"image": args.image})
    chains, walls, phases = [], [], []
    for run in range(args.runs):
        stamps: list[tuple[str, float]] = [("start", time.perf_counter())]
        result = profile(args.model, opts, lambda phase: stamps.append((phase, time.perf_counter())))
        stamps.append(("end", time.perf_counter()))
        walls.append(stamps[-1][1] - stamps[0][1])
        per_phase: dict[str, float] = {}
        for (_, t0), (phase, t1) in zip(stamps, stamps[1:-1]):
            per_phase[phase] = per_phase.get(phase, 0.0) + t1 - t0
        phases.append(per_phase)
        chains.append(result.chain)
        print(f"run {run + 1}: {walls[-1]:.1f} s  (" + ", ".join(f"{k} {v:.1f} s" for k, v in per_phase.items()) + ")")
    if args.save_chain:
        save_chain(chains[0], args.save_chain)

    sizes = {tuple((s.saved_bytes, s.fwd_peak_bytes, s.bwd_peak_bytes, s.need_from) for s in c.stages) + (c.base_bytes,)
             for c in chains}
    per_stage = [[s.fwd_s + s.bwd_s for s in c.stages] for c in chains]
    spreads = []
    for i in range(chains[0].L):
        values = [run[i] for run in per_stage]
        spreads.append((max(values) - min(values)) / statistics.median(values))
    steps = [c.ideal_makespan_s for c in chains]
    step_spread = (max(steps) - min(steps)) / statistics.median(steps)

    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "bench_profiler.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["model", "batch", "image", "device", "run", "wall_s", "stage", "name", "fwd_s", "bwd_s",
                    "saved_bytes", "fwd_peak_bytes", "bwd_peak_bytes"])
        for run, (c, wall) in enumerate(zip(chains, walls), start=1):
            for i, s in enumerate(c.stages, start=1):
                w.writerow([args.model, args.batch, args.image, c.source["device"], run, f"{wall:.3f}", i, s.name,
                            f"{s.fwd_s:.6g}", f"{s.bwd_s:.6g}", s.saved_bytes, s.fwd_peak_bytes, s.bwd_peak_bytes])

    c = chains[0]
    print(f"\n{args.model} batch {args.batch} at {args.image}px on {c.source['device']}: {c.L} stages")
    print(f"profile wall time     median {statistics.median(walls):.1f} s over {args.runs} runs "
          f"(min {min(walls):.1f}, max {max(walls):.1f})")
    print(f"sizes identical       {'yes' if len(sizes) == 1 else 'NO'} across runs")
    print(f"step (fwd+bwd)        median {statistics.median(steps):.3f} s, run-to-run spread {step_spread:.1%}")
    print(f"stage time spread     median {statistics.median(spreads):.1%}, worst {max(spreads):.1%} "
          f"(stage {spreads.index(max(spreads)) + 1}, {c.stages[spreads.index(max(spreads))].name})")
    print(f"wrote {RESULTS / 'bench_profiler.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
