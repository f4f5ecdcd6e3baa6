"""Paper-style reproduction: makespan vs budget of every method on the zoo chains.

    python -m experiments.reproduce          # or: make reproduce

For each model in ``experiments/chains/`` (the GPU-measured ``-cuda`` chain where there is
one, else the CPU-measured ``-cpu`` one; the largest size of each model) and two platforms:

* ``measured``: the chain as profiled.  On the CPU chains the "link" is the CPU stand-in
  (host memcpy, ~10 GB/s) against compute that is ~100x slower than a GPU's, so nearly every
  copy hides: this platform shows memory savings, not the time trade-off;
* ``link-bound``: a what-if on the same measured stages, with both copy directions set to
  the bandwidth at which one D2H of every unit takes exactly the ideal step time, so that
  offloading everything cannot hide.  This is the regime the seed papers study; the
  bandwidth is computed, not measured, and named in each chain.

every method is swept over 17 budgets from 20% to 100% of the no-offload activation peak
(``offload sweep``), and each method's smallest feasible budget is found exactly (the
floor for the exact methods, the policy's own peak for the fixed ones, bisection for the
adaptive swap rankings).  Outputs in ``experiments/results/reproduction/``: one CSV and one
figure per platform, ``smallest.csv`` and ``at_budgets.csv``, whose tables are printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Iterable

from tqdm import tqdm

from offload.analysis.plots import plot_sweep
from offload.analysis.sweep import Row, parse_budgets, sweep, write_rows
from offload.errors import InfeasibleBudget
from offload.io.files import write_csv
from offload.io.text import parse_rate
from offload.profiler.bandwidth import given_platform
from offload.solver.baselines import own_smallest_budget
from offload.solver.floors import bisect_budget
from offload.solver.methods import METHODS, RECOMPUTING, Options, solve
from offload.step.chain import Chain, Platform
from offload.step.chainfile import load_chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget

CHAINS = Path(__file__).parent / "chains"
OUT = Path(__file__).parent / "results" / "reproduction"
EXACT = ("ilp", "relax-lp", "relax-bw")  # feasible down to the floor by construction
POLICIES = [m for m in METHODS if not m.startswith("gist")]  # offloading only (encodings: experiments.encodings)
SHARES = (0.3, 0.5, 0.7)


def sweep_parser(doc: str, out: Path, time_limit: float) -> argparse.ArgumentParser:
    """The command line every sweep over the zoo chains shares (its module docstring as help):
    ``--chains``, ``--time-limit`` per solve, ``--jobs`` and ``--out``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0], epilog=doc.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chains", type=Path, default=CHAINS, help=f"folder of profiled chains (default {CHAINS})")
    ap.add_argument("--time-limit", type=float, default=time_limit,
                    help=f"time limit per solve (default {time_limit:g} s)")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per core)")
    ap.add_argument("--out", type=Path, default=out, help=f"results folder (default {out})")
    return ap


def planned_link(ap: argparse.ArgumentParser, example: str, note: str = "") -> None:
    """The ``--bandwidth RATE`` option the experiments that profile share: the profile plans
    for that link (both ways, no latency) instead of measuring this machine's; ``args.platform``
    holds it (``None``: measured)."""
    ap.add_argument("--bandwidth", dest="platform", type=_planned, default=None, metavar="RATE",
                    help=f"plan for this link (e.g. {example}) instead of the measured one{note}")


def _planned(text: str) -> Platform:
    rate = parse_rate(text)
    return given_platform(rate, rate, 0.0)


def zoo_chains(folder: Path = CHAINS) -> list[Chain]:
    """One chain per model: ``-cuda`` over ``-cpu``, then the most saved bytes (the largest size)."""
    best: dict[str, tuple[tuple, Path]] = {}
    for path in sorted(folder.glob("*-c*.json")):
        m = re.fullmatch(r"(.+?)-b\d+(?:-\d+px)?-(cuda|cpu)\.json", path.name)
        if not m:
            continue
        chain = load_chain(path)
        key = (m.group(2) == "cuda", sum(s.saved_bytes for s in chain.stages))
        if m.group(1) not in best or key > best[m.group(1)][0]:
            best[m.group(1)] = (key, path)
    return [load_chain(p) for _, p in sorted(best.values(), key=lambda kp: kp[1].name)]


def link_bound(chain: Chain) -> Chain:
    """The same stages with the copy bandwidth at which offloading every unit once takes one ideal step."""
    bw = sum(s.saved_bytes for s in chain.stages) / chain.ideal_makespan_s
    platform = dataclasses.replace(chain.platform, d2h_bytes_per_s=bw, h2d_bytes_per_s=bw, latency_s=0.0,
                                   note=f"what-if: {bw / 1e9:.3g} GB/s each way, computed so that one D2H of every "
                                        f"unit takes the ideal step (not measured)")
    return dataclasses.replace(chain, platform=platform)


def slowdown_at(rows: list[dict], share: float, **match: object) -> tuple[float | None, str]:
    """The step time / ideal and status of the sweep row at ``share`` of the peak whose
    fields equal ``match`` (``None, "missing"`` if there is none)."""
    for r in rows:
        if all(r[k] == v for k, v in match.items()) and abs(r["budget_share"] - share) < 1e-3:
            return r["slowdown"], r["status"]
    return None, "missing"


def slowdown_cell(rows: list[dict], share: float, **match: object) -> str:
    """``slowdown_at`` as a table cell: ``-`` when infeasible, ``*`` after a value not proven optimal."""
    slow, status = slowdown_at(rows, share, **match)
    return "-" if slow is None else f"{slow:.3f}{'' if status == 'optimal' else '*'}"


def slowdown_panels(rows: list[dict], names: list[str], platforms: Iterable[str], shares: Iterable[float],
                    field: str, series: Iterable[str], title: str) -> dict[str, dict[str, list[float | None]]]:
    """Bar-chart panels (``analysis.plots.plot_bars``): per platform and budget share (``title``
    formatted with both), per value of ``field``, each chain's step time / ideal."""
    return {title.format(platform=platform, share=share):
            {s: [slowdown_at(rows, share, platform=platform, chain=n, **{field: s})[0] for n in names] for s in series}
            for platform in platforms for share in shares}


def smallest_of(chain: Chain, method: str, options: Options) -> int | None:
    """The smallest activation budget ``method`` meets on ``chain`` (bisection for adaptive
    policies, from the lower bound of the class it schedules: recomputing ones go below the
    offloading floor)."""
    floor, peak = smallest_feasible_budget(chain, recompute=method in RECOMPUTING), no_offload_peak(chain)
    if method in EXACT:
        return floor
    own = own_smallest_budget(chain, method)
    if own is not None:
        return own
    try:
        solve(chain, peak, method, options)
    except InfeasibleBudget:
        return None
    return bisect_budget(chain, method, options, floor - 1, peak, max(1, peak // 10_000))


def main(argv: list[str] | None = None) -> int:
    ap = sweep_parser(__doc__, OUT, time_limit=60)
    ap.add_argument("--budgets", default="20%:100%:17", help="sweep budgets (default 20%%:100%%:17)")
    args = ap.parse_args(argv)
    chains = zoo_chains(args.chains)
    if not chains:
        ap.error(f"no *-cuda.json or *-cpu.json chains in {args.chains}")
    args.out.mkdir(parents=True, exist_ok=True)
    options = Options(time_limit_s=args.time_limit, encodings="none")  # the literature's policies, offloading only
    smallest, at_budgets = [], []
    for scenario, make in (("measured", lambda c: c), ("link-bound", link_bound)):
        rows: list[Row] = []
        for chain in tqdm([make(c) for c in chains], desc=scenario, unit="chain", file=sys.stderr):
            peak = no_offload_peak(chain)
            swept = {b.nbytes for b in parse_budgets(args.budgets, chain)}
            budgets = sorted(swept | {int(s * peak) for s in SHARES})
            chain_rows = sweep(chain, budgets, POLICIES, options, jobs=args.jobs)
            rows += [r for r in chain_rows if r.budget_bytes in swept]
            for method in POLICIES:
                own = smallest_of(chain, method, options)
                smallest.append({"chain": chain.name, "platform": scenario, "method": method,
                                 "smallest_bytes": own if own is not None else "",
                                 "smallest_share": round(own / peak, 4) if own is not None else ""})
                for share in SHARES:
                    r = next(r for r in chain_rows if r.method == method and r.budget_bytes == int(share * peak))
                    at_budgets.append({"chain": chain.name, "platform": scenario, "method": method,
                                       "budget_share": share, "status": r.status,
                                       "slowdown": "" if r.slowdown is None else round(r.slowdown, 4)})
        write_rows(args.out / f"{scenario}.csv", rows)
        plot_sweep(rows, args.out / f"{scenario}.png", title=f"makespan vs budget, {scenario} platform")
    write_csv(args.out / "smallest.csv", smallest)
    write_csv(args.out / "at_budgets.csv", at_budgets)
    _print_tables(chains, smallest, at_budgets)
    print(f"wrote {args.out}/: measured.csv/png, link-bound.csv/png, smallest.csv, at_budgets.csv")
    return 0


def _print_tables(chains: list[Chain], smallest: list[dict], at_budgets: list[dict]) -> None:
    names = [c.name for c in chains]
    print("\nsmallest feasible budget, % of the no-offload activation peak (same on both platforms: memory only)")
    print(f"{'method':<16}" + "".join(f"{n:>16}" for n in names))
    for method in POLICIES:
        cells = {r["chain"]: r["smallest_share"] for r in smallest if r["method"] == method and r["platform"] == "measured"}
        print(f"{method:<16}" + "".join(f"{'never' if cells[n] == '' else f'{100 * cells[n]:.1f}%':>16}" for n in names))
    for scenario in ("measured", "link-bound"):
        for share in SHARES:
            print(f"\nstep time / ideal at {share:.0%} of the peak, {scenario} platform ('-': infeasible)")
            print(f"{'method':<16}" + "".join(f"{n:>16}" for n in names))
            for method in POLICIES:
                cells = {r["chain"]: r["slowdown"] for r in at_budgets
                         if r["method"] == method and r["platform"] == scenario and r["budget_share"] == share}
                print(f"{method:<16}" + "".join(f"{'-' if cells[n] == '' else f'{cells[n]:.3f}':>16}" for n in names))


if __name__ == "__main__":
    raise SystemExit(main())
