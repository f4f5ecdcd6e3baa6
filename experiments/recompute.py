"""Recomputation with offloading vs either alone, on the zoo chains.

    python -m experiments.recompute          # or: make recompute

For each zoo chain of the reproduction (``reproduce.zoo_chains``), on the measured
platform and on the link-bound what-if (``reproduce.link_bound``), at 25%, 35%, 50% and
70% of the no-offload peak: the step time / ideal of three families, each by its exact
MILP (docs/model.md, "Recomputation"): offloading only (``ilp``), recomputation only
(``recompute-only``), both (``ilp --recompute``); and of the heuristics and policies on
the joint class (``relax-lp``/``relax-bw`` with recomputation, ``checkpoint-sqrt``,
``checkpoint-blocks``), no family encoding (``--encodings none``: encodings are
``experiments.encodings``'s).  The smallest feasible budget of each family: offloading's exact
floor (what ``offload show`` prints), recompute-only's and the joint class's bisected with
their MILPs between the joint lower bound and a budget known to be met (``smallest.csv``).

The chains carry what the model needs of a recomputation, measured by the profiler: each
stage's input (the checkpoint), what its unit carries into the next forward, what a
re-run forward holds, the gradient live as its backward starts (docs/model.md,
"Recomputation").  Outputs in ``experiments/results/recompute/``: ``at_budgets.csv`` (one
sweep row per platform and cell), ``smallest.csv``, ``families.png``; the tables are
printed.
"""
from __future__ import annotations

import sys
from pathlib import Path

from offload.analysis.plots import plot_bars
from offload.analysis.sweep import sweep
from offload.io.files import write_csv
from offload.solver import checkpointing
from offload.solver.floors import bisect_budget, joint_floor
from offload.solver.methods import Options
from offload.step.chain import Chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget
from offload.step.simulate import simulate

from .reproduce import link_bound, slowdown_cell, slowdown_panels, sweep_parser, zoo_chains

OUT = Path(__file__).parent / "results" / "recompute"
SHARES = (0.25, 0.35, 0.5, 0.7)
# recomputation against offloading: no family encodes (encodings have their own experiment,
# experiments.encodings), so the floors, the lower bound and every MILP are of one class
ENCODINGS = "none"
# column -> (method, whether --recompute); the first three are the families of the figure
COLUMNS = {"offload only": ("ilp", False), "recompute only": ("recompute-only", False), "joint": ("ilp", True),
           "relax-lp": ("relax-lp", True), "relax-bw": ("relax-bw", True),
           "checkpoint-sqrt": ("checkpoint-sqrt", False), "checkpoint-blocks": ("checkpoint-blocks", False)}
FAMILIES = list(COLUMNS)[:3]
PLATFORMS = {"measured": lambda c: c, "link-bound": link_bound}


def main(argv: list[str] | None = None) -> int:
    ap = sweep_parser(__doc__, OUT, time_limit=20)
    ap.add_argument("--only", default="", help="comma list of chain name prefixes (default: every zoo chain)")
    args = ap.parse_args(argv)
    prefixes = [p for p in args.only.split(",") if p]
    chains = [c for c in zoo_chains(args.chains) if not prefixes or c.name.startswith(tuple(prefixes))]
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    floors: list[dict] = []
    for platform, make in PLATFORMS.items():
        for chain in (make(c) for c in chains):
            peak = no_offload_peak(chain)
            budgets = [int(s * peak) for s in SHARES]
            for family, (method, joint) in COLUMNS.items():
                opts = Options(time_limit_s=args.time_limit, heuristic_time_s=1.0, recompute=joint, encodings=ENCODINGS)
                for r in sweep(chain, budgets, [method], opts, jobs=args.jobs):
                    rows.append({"platform": platform, "family": family, **vars(r)})
            if platform == "measured":  # a floor is memory alone: the same on every platform
                floors.append(_floors(chain, min(args.time_limit, 10)))
            print(f"{platform:<11} {chain.name} done", file=sys.stderr, flush=True)
    write_csv(args.out / "at_budgets.csv", rows)
    write_csv(args.out / "smallest.csv", floors)
    names = [c.name for c in chains]
    panels = slowdown_panels(rows, names, PLATFORMS, SHARES[1:], "family", FAMILIES, "{platform}, {share:.0%} of the peak")
    plot_bars(panels, [n.split("-b")[0] for n in names], "step time / ideal (exact MILP per family)",
              args.out / "families.png", legend="")
    _print_tables(rows, floors, names)
    print(f"wrote {args.out}/: at_budgets.csv, smallest.csv, families.png")
    return 0


def _floors(chain: Chain, time_limit: float) -> dict:
    """Each family's smallest feasible budget as a share of the no-offload peak: offloading's
    exact floor; recompute-only's and the joint class's found by bisection, to half a percent,
    between the joint lower bound (nothing below it) and the least budget known to
    be met (the policies' peaks; for the joint class also the other two floors), each step one
    solve of the family's MILP; and the recompute-only policies' own peaks."""
    peak = no_offload_peak(chain)
    lower, offload_floor = smallest_feasible_budget(chain, recompute=True), smallest_feasible_budget(chain)
    policies = {name: simulate(chain, [], recompute=policy(chain)).peak_bytes
                for name, policy in checkpointing.RECOMPUTE_ONLY.items()}

    # below ``lower`` no schedule of any class fits
    recompute_only = bisect_budget(chain, "recompute-only", Options(time_limit_s=time_limit, heuristic_time_s=1.0,
                                                                    encodings=ENCODINGS),
                                   lower - 1, min(peak, *policies.values()), peak // 200)
    joint = joint_floor(chain, time_limit, 0.005, met=min(offload_floor, recompute_only), encodings=ENCODINGS)
    return {"chain": chain.name, "joint_lower_bound_share": lower / peak, "offload_floor_share": offload_floor / peak,
            "recompute_only_floor_share": recompute_only / peak, "joint_floor_share": joint / peak,
            **{f"{name}_peak_share": b / peak for name, b in policies.items()}}


def _print_tables(rows: list[dict], floors: list[dict], names: list[str]) -> None:
    print("\nsmallest feasible budget, % of the no-offload peak (bisected to 0.5% by each family's MILP; the "
          "policies' own peaks)")
    for f in floors:
        print(f"{f['chain']:<28}" + "".join(f"{k.replace('_share', '')}={100 * v:.1f}%  "
                                            for k, v in f.items() if k != "chain"))
    for platform in PLATFORMS:
        for share in SHARES:
            print(f"\nstep time / ideal at {share:.0%} of the peak, {platform} platform "
                  "('-': infeasible; '*': not proven optimal)")
            print(f"{'chain':<28}" + "".join(f"{f:>18}" for f in COLUMNS))
            for name in names:
                cells = [slowdown_cell(rows, share, platform=platform, chain=name, family=f) for f in COLUMNS]
                print(f"{name:<28}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())
