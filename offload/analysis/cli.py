"""The experiments' subcommands of ``offload``: ``sweep``, ``plot`` and ``trace``."""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from offload.errors import FormatError, Stopped
from offload.io.argtypes import integer, seconds
from offload.io.files import input_path, output_path, write_atomic
from offload.io.text import format_bytes, format_seconds
from offload.solver.cli import add_recompute_arguments
from offload.solver.methods import METHODS, Options
from offload.step.chain import Chain
from offload.step.chainfile import load_chain
from offload.step.encoding import MODE_HELP, MODES
from offload.step.schedulefile import load_schedule

from .sweep import Row, ordered, parse_budgets, parse_methods, read_rows, sweep, unsolved, write_rows
from .timeline import chrome_trace, timeline

PLOT_FORMATS = (".png", ".svg", ".pdf")  # what matplotlib draws well and every viewer opens


def _print_summary(rows: list[Row]) -> None:
    """Per method: from which budget it fits, its slowdown there and at the largest budget, proofs."""
    by_method: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_method[r.method].append(r)
    w = max(19, *(len(m) + 2 for m in by_method))  # the longest method name, then two spaces
    print(f"{'method':<{w}}{'feasible from':>16}{'slowdown there':>16}{'at the top':>12}{'optimal':>9}"
          f"{'errors':>8}{'solve (max)':>13}")
    for method, mrows in by_method.items():
        ok = [r for r in mrows if r.status in ("optimal", "feasible")]
        errors = sum(r.status == "error" for r in mrows)
        proven = f"{sum(r.status == 'optimal' for r in mrows)}/{len(mrows)}"
        if not ok:
            print(f"{method:<{w}}{'never':>16}{'-':>16}{'-':>12}{proven:>9}{errors:>8}{'-':>13}")
            continue
        first, last = ok[0], ok[-1]
        print(f"{method:<{w}}{format_bytes(first.budget_bytes):>16}{first.slowdown:>15.3f}x{last.slowdown:>11.3f}x"
              f"{proven:>9}{errors:>8}{format_seconds(max(r.solve_s for r in ok)):>13}")


FLAT = 0.01  # every schedule that moves bytes within this of the ideal step: the link hides everything


def _flat_link(chain: Chain, rows: list[Row]) -> str | None:
    """Why every method came out equal, when every schedule that copies anything is within
    ``FLAT`` of the ideal step: the chain's link hides every copy (a CPU's memcpy stands in for
    the bus), so the sweep cannot tell the methods apart."""
    moving = [r for r in rows if r.status in ("optimal", "feasible") and (r.d2h_bytes or 0) > 0]
    if not moving or max(r.slowdown for r in moving) > 1 + FLAT:
        return None
    p = chain.platform
    return (f"every schedule that offloads is within {FLAT:.0%} of the ideal step: this chain's link (D2H "
            f"{p.d2h_bytes_per_s / 1e9:.3g} GB/s, latency {format_seconds(p.latency_s)}) hides every copy, so the "
            "methods cannot be told apart; to plan for a GPU's link, profile with --bandwidth (e.g. 25GB/s)")


def cmd_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm
    chain = load_chain(args.chain)
    budgets = parse_budgets(args.budgets, chain, args.total)
    methods = parse_methods(args.methods)
    options = Options(time_limit_s=args.time_limit, heuristic_time_s=args.heuristic_time, encodings=args.encodings,
                      recompute=args.recompute, max_run=args.max_run, in_stage=args.in_stage)
    cells = len(budgets) * len(methods)
    print(f"sweeping {chain.name} ({chain.L} stages): {len(methods)} methods x {len(budgets)} budgets from "
          f"{budgets[0]} to {budgets[-1]}", file=sys.stderr)
    done: list[Row] = []
    try:
        with tqdm(total=cells, desc="sweep", unit="solve", file=sys.stderr, disable=args.quiet) as bar:
            rows = sweep(chain, budgets, methods, options, args.jobs, progress=lambda r: (
                done.append(r), bar.set_postfix_str(f"{r.method} {r.status}", refresh=False), bar.update()))
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the rows done are kept, the others marked
        if not done:
            raise
        finished = {(r.method, r.budget_bytes) for r in done}
        write_rows(args.output, ordered(done + [unsolved(chain, m, b, options, "interrupted") for m in methods
                                                for b in budgets if (m, b.nbytes) not in finished]))
        raise Stopped.of(exc, f"wrote {args.output} with the {len(done)} of {cells} rows done; the others say "
                              "interrupted") from None
    write_rows(args.output, rows)
    _print_summary(rows)
    flat = _flat_link(chain, rows)
    if flat:
        print(f"warning: {flat}", file=sys.stderr)
    print(f"wrote {args.output} ({len(rows)} rows)")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from .plots import plot_sweep, plot_timeline  # matplotlib: only when drawing
    if Path(args.output).suffix.lower() not in PLOT_FORMATS:
        raise FormatError(f"cannot draw {args.output}: unknown picture format {Path(args.output).suffix or '(none)'}",
                          f"name the output with one of {', '.join(PLOT_FORMATS)}, e.g. -o plot.png")
    if args.timeline:
        if len(args.inputs) != 2:
            raise FormatError("plot --timeline needs CHAIN and SCHEDULE",
                              "example: offload plot --timeline chain.json schedule.json -o timeline.png")
        chain = load_chain(args.inputs[0])
        plot_timeline(timeline(chain, load_schedule(args.inputs[1], chain)), args.output)
    else:
        rows = [r for path in args.inputs for r in read_rows(path)]
        plot_sweep(rows, args.output, args.title)
    print(f"wrote {args.output}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    chain = load_chain(args.chain)
    trace = chrome_trace(timeline(chain, load_schedule(args.schedule, chain)))
    write_atomic(args.output, lambda fh: json.dump(trace, fh))
    print(f"wrote {args.output} ({len(trace['traceEvents'])} events); open it in https://ui.perfetto.dev "
          "or chrome://tracing")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="every method at every budget of a range -> results.csv",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Solve CHAIN with each method at each budget (in parallel, one process per core) "
                                   "and write one CSV row per (method, budget): status (optimal = proven, feasible, "
                                   "infeasible, error), makespan, its ratio to the ideal, the lower bound and gap, "
                                   "stalls, peak, bytes moved and solve time. Every schedule is replayed by the "
                                   "simulator; an infeasible budget is a row, not a failure.",
                       epilog="examples:\n  offload sweep chain.json --budgets 30%:100%:15 -o results.csv\n"
                              "  offload sweep chain.json --budgets 2GiB,3GiB,4GiB --methods ilp,relax-lp,vdnn-all "
                              "--total -o r.csv\n  offload plot results.csv -o makespan.png")
    p.add_argument("chain", type=input_path, help="chain.json")
    p.add_argument("--budgets", default="20%:100%:17",
                   help="LO:HI:N evenly spaced budgets, or a comma list; each in bytes, a size (6GiB) or a share of "
                        "the no-offload peak (40%%) (default 20%%:100%%:17)")
    p.add_argument("--methods", default="all", help=f"all, or a comma list of: {', '.join(METHODS)} (default all)")
    p.add_argument("--total", action="store_true", help="budgets count base_bytes too (weights, grads, optimizer state)")
    p.add_argument("--time-limit", type=seconds(), default=60.0, metavar="S",
                   help="wall time of each solve in seconds (default 60)")
    p.add_argument("--heuristic-time", type=seconds(strict=False), default=1.0, metavar="S",
                   help="search time of each relax-* heuristic (default 1)")
    p.add_argument("--encodings", choices=MODES, default="lossless", help=MODE_HELP.replace("%", "%%"))
    add_recompute_arguments(p)
    p.add_argument("--jobs", "-j", type=integer(1, 256), default=None, help="worker processes (default: one per core)")
    p.add_argument("--output", "-o", required=True, type=output_path, help="results CSV (written atomically)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("plot", help="makespan-vs-budget figure of a sweep, or one schedule's timeline",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Draw a sweep's makespan (relative to the ideal) against the budget, one line per "
                                   "method and one panel per chain; or, with --timeline, one schedule's compute, D2H "
                                   "and H2D lanes (stalls in red) above its memory curve and the budget. The format "
                                   "follows the output's extension (png, svg, pdf).",
                       epilog="examples:\n  offload plot results.csv -o makespan.png\n"
                              "  offload plot --timeline chain.json schedule.json -o timeline.png")
    p.add_argument("inputs", nargs="+", metavar="INPUT", type=input_path, help="results CSV(s) of `offload sweep`; with --timeline: "
                                                              "CHAIN SCHEDULE")
    p.add_argument("--timeline", action="store_true", help="plot the timeline of SCHEDULE on CHAIN")
    p.add_argument("--title", help="figure title (sweep plots)")
    p.add_argument("--output", "-o", required=True, type=output_path, help="image file (png, svg or pdf)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("trace", help="export a schedule's simulated timeline as a Chrome/Perfetto trace",
                       description="Write the simulated timeline of SCHEDULE on CHAIN in the trace-event format: "
                                   "threads for compute, D2H and H2D, stalls as events, activation memory as a "
                                   "counter. Open it in https://ui.perfetto.dev or chrome://tracing.")
    p.add_argument("chain", type=input_path, help="chain.json")
    p.add_argument("schedule", type=input_path, help="schedule.json (made for this chain)")
    p.add_argument("--output", "-o", required=True, type=output_path, help="trace JSON")
    p.set_defaults(func=cmd_trace)
