"""Solver benchmark: ILP scaling, heuristic quality, speed, and wall time at scale.

Run with ``make bench`` or ``python -m experiments.bench_solver [--quick] [--part P]``.
Prints every figure and writes the raw rows to ``experiments/results/bench_solver*.csv``.
Chains are ``experiments.synthetic`` chains (seeded; realistic proportions, not
measured), so each row can be reproduced from its (stages, seed, budget share).

1. ILP time to proven optimality (or its gap at the limit) for 10..200 stages, at a
   budget one quarter of the way from the smallest feasible budget to the no-offload peak.
2. Heuristic / ILP makespan ratio over many (chain, budget) pairs, for every method.
3. relax-lp, relax-bw and simulator time on a 1000-stage chain.
4. ``--time-limit`` held at scale: for 50..10000 stages and limits of 20 and 60 s, each solve
   in a fresh process: its wall time, peak RSS, status and gap, and relax-lp / relax-bw
   against the ILP.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments.synthetic import synthetic_chain
from offload.errors import InfeasibleBudget
from offload.io.files import write_csv
from offload.solver.methods import METHODS, Options, solve
from offload.step.memory import no_offload_peak, smallest_feasible_budget
from offload.step.simulate import simulate

RESULTS = Path(__file__).parent / "results"


def budget_at(chain, share: float) -> int:
    """A budget ``share`` of the way from the smallest feasible one to the no-offload peak."""
    lo, hi = smallest_feasible_budget(chain), no_offload_peak(chain)
    return lo + int(share * (hi - lo))


def write_results(name: str, rows: list[dict]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / name, rows)
    return RESULTS / name


def _cell(info: dict, key: str, fmt: str) -> str:
    """``info[key]`` formatted, or ``-`` where the solve has none (a window-by-window solve)."""
    return format(info[key], fmt) if info.get(key) is not None else "-"


def ilp_scaling(sizes, limit_for) -> list[dict]:
    print("\n== 1. ILP: time to prove optimality (budget share 0.25, HiGHS, 2 cores) ==")
    print(f"{'stages':>6} {'status':>10} {'gap':>8} {'build s':>8} {'solve s':>8} {'total s':>8} {'vars':>7} {'nodes':>7} {'vs warm':>8}")
    rows = []
    for L in sizes:
        chain = synthetic_chain(L, seed=1)
        t0 = time.perf_counter()
        r = solve(chain, budget_at(chain, 0.25), "ilp", Options(time_limit_s=limit_for(L)))
        total = time.perf_counter() - t0
        i = r.info  # a long chain is solved window by window: no single model's build, size or nodes
        better = i["warm_start_s"] / r.simulation.makespan_s
        rows.append({"stages": L, "status": r.status, "gap": r.gap, "build_s": i.get("build_seconds"),
                     "solve_s": i.get("solver_seconds"), "total_s": round(total, 3), "time_limit_s": limit_for(L),
                     "variables": i.get("variables"), "constraints": i.get("constraints"), "nodes": i.get("nodes"),
                     "windows": i.get("windows"), "makespan_s": r.simulation.makespan_s,
                     "warm_start_s": i["warm_start_s"], "bound_s": r.bound_s})
        print(f"{L:>6} {r.status:>10} {100 * r.gap:>7.3f}% {_cell(i, 'build_seconds', '>8.2f'):>8} "
              f"{_cell(i, 'solver_seconds', '>8.2f'):>8} {total:>8.2f} {_cell(i, 'variables', '>7'):>7} "
              f"{_cell(i, 'nodes', '>7'):>7} "
              f"{better:>8.4f}" + (f"  ({i['windows']} windows)" if i.get("windows") else ""), flush=True)
    return rows


def heuristic_ratios(pairs, ilp_limit: float) -> list[dict]:
    print(f"\n== 2. makespan / ILP makespan over {len(pairs)} (chain, budget) pairs ==")
    rows = []
    for n, (L, seed, share) in enumerate(pairs, start=1):
        chain = synthetic_chain(L, seed=seed)
        budget = budget_at(chain, share)
        ilp = solve(chain, budget, "ilp", Options(time_limit_s=ilp_limit))
        for name in METHODS:
            try:
                r = ilp if name == "ilp" else solve(chain, budget, name)
                span, ratio = r.simulation.makespan_s, r.simulation.makespan_s / ilp.simulation.makespan_s
            except InfeasibleBudget:
                span = ratio = None
            rows.append({"stages": L, "seed": seed, "share": share, "budget_bytes": budget, "method": name,
                         "makespan_s": span, "ratio_to_ilp": ratio, "ilp_status": ilp.status, "ilp_gap": ilp.gap})
        print(f"\r  {n}/{len(pairs)} pairs", end="", flush=True)
    print()
    proven = {(r["stages"], r["seed"], r["share"]) for r in rows if r["method"] == "ilp" and r["ilp_status"] == "optimal"}
    print(f"  ILP proven optimal on {len(proven)}/{len(pairs)} pairs; ratios below use all pairs (ILP incumbent)")
    print(f"  {'method':<15} {'feasible':>9} {'median':>8} {'p90':>8} {'worst':>8}")
    for name in METHODS:
        ratios = sorted(r["ratio_to_ilp"] for r in rows if r["method"] == name and r["ratio_to_ilp"] is not None)
        if not ratios:
            print(f"  {name:<15} {0:>9}")
            continue
        p90 = ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))]
        print(f"  {name:<15} {len(ratios):>5}/{len(pairs):<3} {statistics.median(ratios):>8.4f} {p90:>8.4f} {ratios[-1]:>8.4f}")
    return rows


def large_chain_speed(L: int = 1000, repeats: int = 20) -> list[dict]:
    print(f"\n== 3. speed at {L} stages (budget share 0.25) ==")
    chain = synthetic_chain(L, seed=7)
    budget = budget_at(chain, 0.25)
    rows = []
    for name in ("relax-lp", "relax-bw"):
        t0 = time.perf_counter()
        r = solve(chain, budget, name)
        sec = time.perf_counter() - t0
        rows.append({"what": name, "seconds": round(sec, 4), "makespan_s": r.simulation.makespan_s, "gap": r.gap})
        print(f"  {name:<9} {sec:7.3f} s  (solve() wall time, LP bound included)  makespan {r.simulation.makespan_s:.4f} s, gap {100 * r.gap:.2f}%")
    plan = r.schedule.offloads
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        simulate(chain, plan, budget)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    rows.append({"what": "simulate", "seconds": round(med, 5), "makespan_s": None, "gap": None})
    print(f"  simulate  {1e3 * med:7.2f} ms (median of {repeats}, {len(plan)} offloaded units)")
    return rows


def peak_rss_bytes() -> int:
    """This process's own peak resident memory.  Not ``ru_maxrss``: Linux carries the
    parent's resident size at fork into it across exec, so every cell of part 4 reported the
    577 MiB of the benchmark process that started it (measured: a child of a 500 MiB parent
    reports 513 MiB there, 13 MiB as its own high-water mark ``VmHWM``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:  # not Linux: the rusage figure, an upper bound
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one_scale_cell(L: int, limit: float) -> dict:
    """One cell of part 4, in this process (its peak RSS is this solve's)."""
    chain = synthetic_chain(L, seed=7)
    budget = budget_at(chain, 0.25)
    t0 = time.perf_counter()
    ilp = solve(chain, budget, "ilp", Options(time_limit_s=limit))
    wall = time.perf_counter() - t0
    rss = peak_rss_bytes()
    row = {"stages": L, "time_limit_s": limit, "wall_s": round(wall, 2), "peak_rss_bytes": rss,
           "ilp_status": ilp.status, "ilp_gap": ilp.gap, "ilp_makespan_s": ilp.simulation.makespan_s,
           "windows": ilp.info.get("windows"), "bound_note": ilp.info.get("bound_note", "")}
    for name in ("relax-lp", "relax-bw"):
        t0 = time.perf_counter()
        r = solve(chain, budget, name, Options(time_limit_s=limit))
        row[f"{name}_s"] = round(time.perf_counter() - t0, 2)
        row[f"{name}_vs_ilp"] = r.simulation.makespan_s / ilp.simulation.makespan_s
    return row


def scale(sizes, limits) -> list[dict]:
    print("\n== 4. the time limit held at scale (each solve in a fresh process) ==")
    print(f"{'stages':>6} {'limit':>6} {'wall s':>7} {'RSS MiB':>8} {'status':>10} {'gap':>8} {'windows':>8} "
          f"{'lp/ilp':>7} {'bw/ilp':>7} {'lp s':>6} {'bw s':>6}")
    rows = []
    for L in sizes:
        for limit in limits:
            run = subprocess.run([sys.executable, "-m", "experiments.bench_solver", "--one", str(L), str(limit)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(run.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(f"{L:>6} {limit:>6g} {r['wall_s']:>7.1f} {r['peak_rss_bytes'] / 2**20:>8.0f} {r['ilp_status']:>10} "
                  f"{100 * r['ilp_gap']:>7.3f}% {r['windows'] or '-':>8} {r['relax-lp_vs_ilp']:>7.4f} "
                  f"{r['relax-bw_vs_ilp']:>7.4f} {r['relax-lp_s']:>6.1f} {r['relax-bw_s']:>6.1f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes only (a smoke run, about a minute)")
    ap.add_argument("--part", choices=("all", "ilp", "ratios", "speed", "scale"), default="all", help="run one part only")
    ap.add_argument("--one", nargs=2, type=float, metavar=("STAGES", "LIMIT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_scale_cell(int(args.one[0]), args.one[1])))
        return
    if args.quick:
        sizes, pairs, ilp_limit = (10, 25), [(L, s, sh) for L in (8, 12) for s in (1, 2) for sh in (0.1, 0.4)], 10.0
        large = 300
    else:
        sizes, ilp_limit, large = (10, 25, 50, 100, 200), 20.0, 1000
        pairs = [(L, s, sh) for L in (10, 16, 24) for s in range(1, 6) for sh in (0.05, 0.15, 0.3, 0.5)]
    suffix = "_quick" if args.quick else ""
    t0 = time.perf_counter()
    parts = {
        "ilp_scaling": lambda: ilp_scaling(sizes, lambda L: 30.0 if L <= 50 else 60.0),
        "ratios": lambda: heuristic_ratios(pairs, ilp_limit),
        "speed": lambda: large_chain_speed(large),
        "scale": lambda: scale((50, 300) if args.quick else (50, 100, 300, 1000, 10000), (5,) if args.quick else (20, 60)),
    }
    for name, run in parts.items():
        if args.part in ("all", name.split("_")[0]):
            print(f"wrote {write_results(f'bench_solver_{name}{suffix}.csv', run())}")
    print(f"benchmark wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
