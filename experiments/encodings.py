"""Encoding with offloading vs offloading alone, on the zoo CNNs.

    python -m experiments.encodings          # or: make encodings

For each zoo chain the reproduction uses (``reproduce.zoo_chains``: one per model in
``experiments/chains/``) that offers encodings (ReLU sign masks, sparse storage, bf16), on
the measured platform and on the link-bound what-if of the reproduction
(``reproduce.link_bound``):

* the smallest feasible budget, offloading alone (the plain floor) against encoding and
  offloading (the exact encoded floor, lossless, then lossy), and without any offloading:
  the no-offload peak against Gist (every unit encoded, lossless, then lossy);
* the ILP's step time at 50% and 30% of the no-offload peak with encodings none, lossless
  and lossy (the solver chooses per unit: keep, keep encoded, offload, offload encoded).

Outputs in ``experiments/results/encodings/``: ``smallest.csv``, ``at_budgets_by_platform.csv`` (one sweep
row per platform and cell, with status, gap and encoded units), ``encodings.png``; the tables are printed.

``--bound`` drops what the profiler measured an encoded unit's ops to hold
(``offload.profiler.encoded_memory``) and solves with the bound the chain falls back to: the
same chains run both ways tell what the measurement buys::

    python -m experiments.profile_zoo --set small --device cpu --repeats 3 --out /tmp/zoo
    python -m experiments.encodings --chains /tmp/zoo --out /tmp/measured
    python -m experiments.encodings --chains /tmp/zoo --out /tmp/bound --bound
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from offload.analysis.plots import plot_bars
from offload.analysis.sweep import sweep
from offload.io.files import write_csv
from offload.solver import encoded_floor
from offload.solver.methods import Options
from offload.step import encoding
from offload.step.chain import Chain
from offload.step.chainfile import make_chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget
from offload.step.simulate import simulate

from .reproduce import link_bound, slowdown_cell, slowdown_panels, sweep_parser, zoo_chains

OUT = Path(__file__).parent / "results" / "encodings"
SHARES = (0.5, 0.3)


def bound(chain: Chain) -> Chain:
    """``chain`` with its encodings' measured op memory dropped: the bound stands (docs/encodings.md)."""
    unmeasured = dict(fwd_held_bytes=None, next_held_bytes=None, bwd_held_bytes=None)
    stages = [replace(s, encodings=tuple(replace(e, **unmeasured) for e in s.encodings)) for s in chain.stages]
    return make_chain(chain.name, stages, chain.platform, chain.base_bytes, chain.source, chain.recipe,
                      chain.workspace_bytes)


def smallest_budgets(chain: Chain) -> dict:
    """Every smallest budget of the module docstring, in bytes and as a share of the peak."""
    peak = no_offload_peak(chain)
    cells = {"no_offload_peak": peak, "offload": smallest_feasible_budget(chain)}
    for mode in ("lossless", "lossy"):
        cells[f"offload+{mode}"] = encoded_floor.floor(chain, mode)[0]
        cells[f"gist-{mode}"] = simulate(chain, [], encode=encoding.smallest(chain, mode)).peak_bytes
    return {"chain": chain.name, **cells,
            **{f"{k}_share": round(v / peak, 4) for k, v in cells.items() if k != "no_offload_peak"}}


def main(argv: list[str] | None = None) -> int:
    ap = sweep_parser(__doc__, OUT, time_limit=60)
    ap.add_argument("--bound", action="store_true",
                    help="drop the encodings' measured op memory: solve with the bound instead")
    args = ap.parse_args(argv)
    chains = [bound(c) if args.bound else c for c in zoo_chains(args.chains) if c.has_encodings]
    if not chains:
        ap.error(f"no chain with encodings in {args.chains}: profile them with python -m experiments.profile_zoo "
                 f"--set small --out {args.chains}")
    args.out.mkdir(parents=True, exist_ok=True)
    smallest = [smallest_budgets(c) for c in chains]
    rows: list[dict] = []
    for platform, make in (("measured", lambda c: c), ("link-bound", link_bound)):
        for chain in (make(c) for c in chains):
            peak = no_offload_peak(chain)
            for mode in encoding.MODES:
                opts = Options(time_limit_s=args.time_limit, encodings=mode)
                for r in sweep(chain, [int(s * peak) for s in SHARES], ["ilp"], opts, jobs=args.jobs):
                    rows.append({"platform": platform, **vars(r)})
            print(f"{platform:<11} {chain.name} done", file=sys.stderr, flush=True)
    write_csv(args.out / "smallest.csv", smallest)
    write_csv(args.out / "at_budgets_by_platform.csv", rows)
    names = [c.name for c in chains]
    panels = slowdown_panels(rows, names, ("measured", "link-bound"), SHARES, "encodings", encoding.MODES,
                             "{platform}, budget {share:.0%} of the peak")
    plot_bars(panels, [n.split("-b")[0] for n in names], "ILP step time / ideal", args.out / "encodings.png",
              legend="encodings: ")
    _print_tables(smallest, rows, [c.name for c in chains])
    print(f"wrote {args.out}/: smallest.csv, at_budgets_by_platform.csv, encodings.png")
    return 0


def _print_tables(smallest: list[dict], rows: list[dict], names: list[str]) -> None:
    print("\nsmallest feasible activation budget, % of the no-offload peak")
    cols = ("offload", "offload+lossless", "offload+lossy", "gist-lossless", "gist-lossy")
    print(f"{'chain':<28}" + "".join(f"{c:>18}" for c in cols))
    for s in smallest:
        print(f"{s['chain']:<28}" + "".join(f"{100 * s[c + '_share']:>17.1f}%" for c in cols))
    for platform in ("measured", "link-bound"):
        for share in SHARES:
            print(f"\nILP step time / ideal at {share:.0%} of the peak, {platform} platform "
                  "('-': infeasible; '*': time limit, best found)")
            print(f"{'chain':<28}" + "".join(f"{m:>14}" for m in encoding.MODES))
            for name in names:
                cells = [slowdown_cell(rows, share, platform=platform, chain=name, encodings=m) for m in encoding.MODES]
                print(f"{name:<28}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())
