"""The solver's subcommands of ``offload``: ``show``, ``simulate``, ``solve``.

Each stage package contributes its own subcommands (``add_commands``); ``offload.cli``
assembles them, so the solver never depends on the torch-based stages.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from offload.errors import FormatError
from offload.io.argtypes import fraction, integer, seconds
from offload.io.contention import busy_warning
from offload.io.files import input_path, output_path
from offload.io.text import clipped, copies_off, format_bytes, format_seconds, printable
from offload.step.budget import Budget
from offload.step.chain import RECORDED_TIMES, Chain
from offload.step.chainfile import load_chain
from offload.step.encoding import MODE_HELP, MODES, allowed, encoded_bytes
from offload.step.graph import write_graphml
from offload.step.memory import no_offload_peak, op_memory, op_name, smallest_feasible_budget
from offload.step.names import other_kernels
from offload.step.schedulefile import load_schedule, save_schedule
from offload.step.simulate import Simulation

from .encoded_floor import floor
from .floors import joint_floor
from .methods import METHODS, RECOMPUTING, Options, Result, solve
from .pulp_backend import SOLVERS

# solve and verify compiled (solve --verify): chain, budget, method, options, a line printer
Verified = Callable[[Chain, Budget, str, Options, Callable[[str], None]], Result]

MAX_NOTES = 12  # a chain's source notes shown by show and profile (a hand-made chain may hold any number)
NAME_WIDTH = 48  # the widest stage name show prints whole (a longer one keeps its end)
BUDGET_HELP = ("memory budget: bytes (4000000000), a size (6GiB, 800MB) or a share of the no-offload peak "
               "(60%%); activation memory unless --total")


def _recorded_line(chain: Chain) -> None:
    """What the recomputable stages take recorded for a re-run, where the chain times it."""
    again = sorted(k for k in chain.recomputable
                   if any(getattr(chain.stage(k), key) is not None for key in RECORDED_TIMES))
    if not again:
        return
    compiled = chain.recipe is not None and other_kernels(chain.recipe.compile)
    why = (f"eagerly, as a recorded stage of a model compiled by {chain.recipe.compile} runs" if compiled
           else "the recording's and the replay's own work in them (a CPU's host is its device)")
    backward = (f", backwards after one {format_seconds(float(chain.br[again].sum()))} "
                f"({format_seconds(float(chain.b[again].sum()))})" if (chain.br != chain.b).any() else "")
    _line("recorded", f"{len(again)} stages timed as the executor records them for a re-run, {why}: forwards "
          f"{format_seconds(float(chain.fr[again].sum()))} (timed plainly: {format_seconds(float(chain.f[again].sum()))}),"
          f" re-runs {format_seconds(float(chain.rr[again].sum()))}{backward}")


def _line(label: str, text: str) -> None:
    print(f"{label:<12} {text}")


def _print_crossing(chain: Chain) -> None:
    """The boundaries that several values cross, as the profiler found them (``source.crossing``)."""
    crossing = chain.source.get("crossing")
    if not isinstance(crossing, dict) or not crossing:
        return
    print()
    print("crossing    boundaries that several values cross: the stage's output first, then the values made "
          "before it and read after it (held by the model's code; what a stage saves of them is in its unit)")
    shown = 0
    for k, values in crossing.items():
        if not (isinstance(values, list) and str(k).isdigit() and 1 <= int(k) < chain.L):
            continue
        if shown == MAX_NOTES:
            print(f"{'':>4} … and {len(crossing) - MAX_NOTES} more in the chain's source.crossing")
            break
        shown += 1
        name = printable(chain.stage(int(k)).name)
        print(f"{int(k):>4} after {name}: {clipped(', '.join(printable(str(x)) for x in values), 400)}")


def _print_restorable(chain: Chain) -> None:
    """The held parts a schedule may take off the device with their units and bring back for
    their next reader (``Offload.restore``)."""
    if chain.restorable:
        print("restorable  held parts that may leave the device with their unit and come back for their reader: "
              + ", ".join(f"U{i} {format_bytes(chain.stage(i).held_bytes)} (read by F{chain.stage(i).held_read_at})"
                          for i in chain.restorable))


def _print_staying(chain: Chain) -> None:
    """The storages that stay on the device, in no unit: because a stage after the next saves
    them too, or because the forward lets them go before the backward."""
    shared = [(k, s.shared_saves) for k, s in enumerate(chain.stages, 1) if s.shared_saves]
    dropped = [(k, s.dropped_saves) for k, s in enumerate(chain.stages, 1) if s.dropped_saves]
    if shared or dropped:
        print()
    if shared:
        print("shared      storages a stage after the next saves too: in no unit, they stay on the device (their "
              "bytes in the transients), so each unit is needed from its own backward: " + _storages(shared))
    if dropped:
        print("dropped     storages the forward saves and lets go before the backward (the graph of an output the "
              "model discards): in no unit, they stay on the device until they die (their bytes in the "
              "transients), and no copy moves them: " + _storages(dropped))


def _storages(per_stage: list[tuple[int, tuple[int, ...]]]) -> str:
    return ", ".join(f"U{k} #{', #'.join(map(str, v))}" for k, v in per_stage)


def print_chain(chain: Chain) -> None:
    """The chain at a glance: source, platform, stages, peak, ideal makespan, smallest budget."""
    src = chain.source
    print(f"chain {printable(chain.name)!r}: {chain.L} stages, sha256 {chain.sha256[:12]}…")
    if chain.recipe is not None:
        r = chain.recipe
        print(printable(f"model       {r.model}, batch {r.batch}, {r.dtype}, optimizer {r.optimizer}, seed {r.seed}"
                        + "".join(f", {k}={v}" for k, v in r.options.items())
                        + (f"; autocast {r.autocast}" if r.autocast else "")
                        + (f"; compiled as one graph (torch.compile, backend {r.compile}: train it with "
                           "compile_scheduled)" if r.whole_graph else
                           f"; compiled (torch.compile, backend {r.compile})" if r.compile else "")))
    if src:
        print("source      " + clipped(", ".join(f"{k}={clipped(v, 200)}" for k, v in src.items()
                                                  if not isinstance(v, (dict, list))), 1000))
        notes = list(src.get("notes", ())) if isinstance(src.get("notes"), list) else []
        for note in notes[:MAX_NOTES]:  # what the profiler found worth saying (stages it cannot re-run...)
            print(f"note        {clipped(note, 400)}")
        if len(notes) > MAX_NOTES:
            print(f"note        … and {len(notes) - MAX_NOTES} more notes in the chain's source.notes")
        share = src.get("cpu_wait_share")
        for warning in busy_warning(share if isinstance(share, (int, float)) else None, "its profile"):
            print(f"warning     {warning}")
    p = chain.platform
    print(f"platform    D2H {p.d2h_bytes_per_s / 1e9:.2f} GB/s, H2D {p.h2d_bytes_per_s / 1e9:.2f} GB/s, "
          f"latency {format_seconds(p.latency_s)}" + (f" ({printable(p.note)})" if p.note else ""))
    copies = ("per storage copied, each way", float(chain.ns.sum()), "to move every unit out")
    saves = ("per saved tensor of a unit it moves, encodes or rebuilds, each way", float(chain.hh.sum()),
             "to handle every unit")
    for label, cost, (per, count, all_of), where in (
            ("host", p.copy_host_s, copies, "charged to the host's clock"),
            ("copying", p.copy_device_s, copies, "this host runs the ops: charged to the op that issues the copy"),
            ("host", p.handle_host_s, saves, "charged to the host's clock"),
            ("handling", p.handle_device_s, saves, "this host runs the ops: charged to the unit's Fi and Bi")):
        if cost:
            print(f"{label:<12}the executor's {format_seconds(cost)} {per}: {format_seconds(cost * count)} {all_of} "
                  f"({where})")
    print()
    casts = bool(chain.castable)  # a column of the weight casts each stage makes again
    names = [printable(s.name) for s in chain.stages]
    width = min(NAME_WIDTH, max(len("name"), *map(len, names)))
    print(f"{'#':>4} {'name':<{width}} {'kind':<10} {'fwd':>10} {'bwd':>10} {'saved':>11} {'fwd peak':>11} {'bwd peak':>11} "
          f"{'need':>5}" + (f" {'casts':>11}" if casts else ""))
    for i, (s, name) in enumerate(zip(chain.stages, names), start=1):
        # a name too long keeps its end, where the names of a model's stages differ
        name = name if len(name) <= width else "…" + name[1 - width:]
        print(f"{i:>4} {name:<{width}} {printable(s.kind)[:10]:<10} {format_seconds(s.fwd_s):>10} {format_seconds(s.bwd_s):>10} "
              f"{format_bytes(s.saved_bytes):>11} {format_bytes(s.fwd_peak_bytes):>11} {format_bytes(s.bwd_peak_bytes):>11} "
              f"{s.need_from:>5}" + (f" {format_bytes(s.cast_bytes):>11}" if casts else ""))
    _print_crossing(chain)
    _print_staying(chain)
    _print_restorable(chain)
    if chain.has_encodings:
        print()
        print("encodings   (unit size once encoded, encode / decode time, what Fi holds over its raw peak: measured "
              "with the encoding on, or the bound)")
        for i, s in enumerate(chain.stages, start=1):
            for e in s.encodings:
                held = e.fwd_extra_bytes
                print(f"{i:>4} {printable(e.name):<12} {'lossless' if e.lossless else 'lossy':<9} "
                      f"{format_bytes(encoded_bytes(chain, i, e)):>11} of {format_bytes(s.saved_bytes):<11} "
                      f"{format_seconds(e.encode_s):>10} / {format_seconds(e.decode_s):<10} "
                      f"Fi {'+' if held >= 0 else '-'}{format_bytes(abs(held))}"
                      f"{' (bound)' if e.fwd_held_bytes is None else ''}  "
                      + ", ".join(f"{t.encoder}#{t.index}" for t in e.tensors))
    if any(s.options for s in chain.stages):
        print()
        print("options     in-stage, measured: what each keeps of its unit and re-runs before the backward, of its "
              "stage's whole re-run (a schedule's run `3:matmuls`)")
        for i, s in enumerate(chain.stages, start=1):
            for o in s.options:
                print(f"{i:>4} {printable(o.name):<18} keeps {format_bytes(o.kept_bytes):>11} of "
                      f"{format_bytes(s.saved_bytes):<11} re-runs {format_seconds(o.recompute_s):>10} of "
                      f"{format_seconds(s.rerun)}")
    print()
    peak = no_offload_peak(chain)
    plain_floor = smallest_feasible_budget(chain)
    o = int(op_memory(chain, ()).argmax())
    _line("no-offload", f"activation peak {format_bytes(peak)} at {op_name(chain, o)}"
          + (f"; total {format_bytes(peak + chain.base_bytes)} with base {format_bytes(chain.base_bytes)}" if chain.base_bytes else ""))
    if chain.castable:
        _line("casts", f"{format_bytes(int(chain.cb.sum()))} of weight casts (autocast) in {len(chain.castable)} "
              f"stages, {format_bytes(int(chain.cb.max()))} in the largest: made again by the backward "
              f"({format_seconds(float(chain.rc.sum()))} in all) unless a schedule has the room to keep them")
    if chain.workspace_bytes:
        _line("workspaces", f"{format_bytes(chain.workspace_bytes)} of the base held by no tensor (cuBLAS/cuDNN "
              "workspaces, allocator rounding): made in step 1, kept; a run counts any more as activations")
    host = float(chain.fh.sum() + chain.bh.sum())
    if host:
        device = float(chain.f.sum() + chain.b.sum())
        slower = sum(int(chain.fh[i] > chain.f[i]) + int(chain.bh[i] > chain.b[i]) for i in range(1, chain.L + 1))
        _line("ideal", f"makespan {format_seconds(chain.ideal_makespan_s)} (no stall; the device's op times add up "
              f"to {format_seconds(device)}, the host's time to issue them to {format_seconds(host)}, slower than "
              f"the device in {slower} of {2 * chain.L} ops: recomputing there costs host time)")
        if chain.rech.any() or any(s.rerun_host_s for s in chain.stages):
            again = sorted(chain.recomputable)
            _line("re-runs", f"the host issues the executor's re-run of the {len(again)} recomputable stages in "
                  f"{format_seconds(float(chain.rh[again].sum()))} (their forwards: "
                  f"{format_seconds(float(chain.fh[again].sum()))}) and records them as they run for "
                  f"{format_seconds(float(chain.rech[again].sum()))} more")
    else:
        _line("ideal", f"makespan {format_seconds(chain.ideal_makespan_s)} (sum of all op times"
              + (", no weight cast made again)" if chain.castable else ")"))
    _recorded_line(chain)
    plain, hooked = chain.source.get("plain_step_s"), chain.source.get("step_s")
    if plain and hooked and not (chain.recipe and chain.recipe.whole_graph):  # the hooks' cost (no hook in a graph)
        _line("plain", f"step {format_seconds(plain['median'])} as plain PyTorch runs it, timed beside the profile's "
              f"steps ({format_seconds(hooked['median'])} with the executor's hooks on every saved tensor, "
              f"{100 * (hooked['median'] / plain['median'] - 1):+.0f}%; `train --compare` holds its no-offload step "
              "against it)")
    _line("smallest", f"feasible activation budget {format_bytes(plain_floor)} ({plain_floor} B, "
          f"{100 * plain_floor / peak:.1f}% of the peak)" if peak else "feasible budget 0 B")
    for mode in ("lossless", "lossy"):
        if allowed(chain, mode):
            low = floor(chain, mode)[0]
            _line("", f"with {mode} encodings: {format_bytes(low)} ({low} B, {100 * low / peak:.1f}% of the peak)")
    if peak:  # what solve --recompute refuses below: with its default encodings
        low, alone = floor(chain, Options.encodings, recompute=True)[0], smallest_feasible_budget(chain, recompute=True)
        _line("", f"with recomputation (--recompute): no lower than {format_bytes(low)} ({100 * low / peak:.1f}% of the "
              f"peak{'' if low == alone else f'; {100 * alone / peak:.1f}% with --encodings none'}; "
              f"{len(chain.recomputable)} of {chain.L - 1} stages recomputable, docs/model.md, \"Recomputation\")")


def cmd_show(args: argparse.Namespace) -> int:
    chain = load_chain(args.chain)
    print_chain(chain)
    peak = no_offload_peak(chain)
    if args.exact_floor is not None and peak:
        print(f"bisecting the joint MILP's smallest budget ({format_seconds(args.exact_floor)} a solve) ...", flush=True)
        low = joint_floor(chain, args.exact_floor)
        _line("", f"with recomputation, exact: {format_bytes(low)} ({low} B, {100 * low / peak:.1f}% of the peak; "
              f"the least budget the joint MILP meets, to 0.5% of the peak, at most that where a solve ran out of time)")
    if args.graphml:
        write_graphml(chain, args.graphml)
        print(f"wrote {args.graphml}")
    return 0


def _print_simulation(chain: Chain, sim: Simulation, base: int) -> None:
    ideal = chain.ideal_makespan_s
    _line("makespan", f"{format_seconds(sim.makespan_s)}  (ideal {format_seconds(ideal)}, "
          f"{100 * (sim.makespan_s - ideal) / ideal if ideal else 0:+.2f}%)")
    _line("stalls", f"{format_seconds(sim.stall_s)}")
    _line("peak", f"{format_bytes(sim.peak_bytes + base)} at {sim.peak_op}" + (" (total)" if base else " (activations)"))
    _line("moved", f"D2H {format_bytes(sim.d2h_bytes)}, H2D {format_bytes(sim.h2d_bytes)}")
    _line("offloaded", f"{len(sim.offloads)} of {len(chain.offloadable)} offloadable units")
    restored = [o for o in sim.offloads if o.restore]
    if restored:
        _line("restored", ", ".join(f"U{o.stage}'s held part off the device F{o.release + 1}..F{o.restore - 1}"
                                    for o in restored))
    if sim.encode:
        _line("encoded", ", ".join(f"U{i} {name}" for i, name in sorted(sim.encode.items())))
    if sim.recompute:
        _line("recomputed", ", ".join(r.text for r in sim.recompute)
              + f" ({format_seconds(sim.recomputed_s)} of forward ops re-run)")
    if chain.castable:
        kept = sim.casts_kept
        _line("casts", (f"kept in {len(kept)} of {len(chain.castable)} stages ({format_bytes(int(chain.cb[list(kept)].sum()))}, "
                        f"{format_seconds(float(chain.rc[list(kept)].sum()))} of recasts saved)") if kept
              else f"made again by the backward in all {len(chain.castable)} stages")


def cmd_simulate(args: argparse.Namespace) -> int:
    chain = load_chain(args.chain)
    sched = load_schedule(args.schedule, chain)
    budget = Budget.parse(args.budget, chain, args.total) if args.budget is not None else sched.budget
    base = budget.base(chain) if budget else 0
    sim = sched.simulate(chain, budget)
    if args.json:
        json.dump({"makespan_s": sim.makespan_s, "peak_bytes": sim.peak_bytes + base, "stall_s": sim.stall_s,
                   "ops": [vars(o) for o in sim.ops], "copies": [vars(c) for c in sim.copies],
                   "recomputes": [vars(r) for r in sim.recomputes]}, sys.stdout, indent=2)
        print()
        return 0
    print(f"schedule {printable(sched.method) or '?'} for chain {printable(chain.name)!r}" + (f", budget {budget}" if budget else ""))
    _print_simulation(chain, sim, base)
    if args.timeline:
        print()
        print(f"{'op':>6} {'ready':>12} {'start':>12} {'end':>12} {'stall':>11} {'memory':>11}")
        for o in sim.ops:
            print(f"{o.name:>6} {o.ready:>12.6f} {o.start:>12.6f} {o.end:>12.6f} {o.stall:>11.6f} {format_bytes(o.mem_bytes + base):>11}")
        print(f"\n{'copy':>6} {'stage':>6} {'issue':>12} {'start':>12} {'end':>12} {'bytes':>11}")
        for c in sim.copies:
            print(f"{c.direction:>6} {c.stage:>6} {c.issue:>12.6f} {c.start:>12.6f} {c.end:>12.6f} {format_bytes(c.nbytes):>11}")
        if sim.recomputes:
            print(f"\n{'re-run':>6} {'in op':>6} {'start':>12} {'end':>12} {'memory':>11}")
            for r in sim.recomputes:
                print(f"{'F' + str(r.stage):>6} {'B' + str(r.op_stage):>6} {r.start:>12.6f} {r.end:>12.6f} "
                      f"{format_bytes(r.mem_bytes + base):>11}")
    return 0


def add_recompute_arguments(p: argparse.ArgumentParser) -> None:
    """``--recompute``, ``--max-run`` and ``--no-in-stage`` (``Options.recompute``, ``Options.max_run``,
    ``Options.in_stage``), for solve and sweep."""
    p.add_argument("--recompute", action="store_true",
                   help="ilp and relax-* may also recompute runs of stages instead of keeping or offloading their "
                        "units (recompute-only and checkpoint-* always do); see docs/model.md, \"Recomputation\"")
    p.add_argument("--max-run", type=integer(1, 64), default=8, metavar="N",
                   help="longest run of stages recomputed together that the ILP considers (default 8)")
    p.add_argument("--no-in-stage", dest="in_stage", action="store_false",
                   help="ilp, relax-* and recompute-only decide per stage only: no stage re-run in part (its in-stage "
                        "options, e.g. 3:matmuls; docs/model.md, \"In-stage options\")")


def cmd_solve(args: argparse.Namespace) -> int:
    if args.list_methods:
        for m in METHODS.values():
            print(f"{m.name:<18} {m.description}")
        return 0
    if args.chain is None or args.budget is None:
        raise FormatError("solve needs CHAIN and --budget", "example: offload solve chain.json --budget 60% -o schedule.json")
    chain = load_chain(args.chain)
    budget = Budget.parse(args.budget, chain, args.total)
    opts = Options(time_limit_s=args.time_limit, gap=args.gap, threads=args.threads, solver=args.solver,
                   heuristic_time_s=args.heuristic_time, verbose=args.verbose, encodings=args.encodings,
                   recompute=args.recompute, max_run=args.max_run, in_stage=args.in_stage)
    for note in _unused_flags(args):
        print(f"note: {note}", file=sys.stderr)
    if args.method == "ilp" and not args.verify:  # (--verify says when it solves, after its checks)
        print(f"solving with {args.solver} (time limit {args.time_limit:g} s, proven at a gap of {_percent(args.gap)})…",
              file=sys.stderr, flush=True)
    if args.verify:
        res = args.verified(chain, budget, args.method, opts, lambda line: print(f"verify: {line}", file=sys.stderr,
                                                                                  flush=True))
    else:
        res = solve(chain, budget, args.method, opts)
    _line("chain", f"{printable(chain.name)} ({chain.L} stages), budget {budget}")
    _line("method", f"{args.method}: {res.status}, gap {_percent(res.gap)} to the best lower bound "
          f"{format_seconds(res.bound_s)}, {res.seconds:.2f} s")
    if "note" in res.info:
        _line("note", res.info["note"])
    if "verified" in res.info:
        _line("verified", _verified_line(res.info["verified"], budget.activations(chain)))
    elif chain.recipe and chain.recipe.whole_graph and (res.schedule.offloads or res.schedule.recompute):
        _line("verified", "not: each op's memory comes from the profile's compiles, not this schedule's (a compiled "
                          "ViT recomputing a stage beside an offloaded neighbour held 65 KiB over it); --verify "
                          "compiles this one and meters it op by op, solving again for less where an op held more "
                          "than the budget")
    _print_simulation(chain, res.simulation, budget.base(chain))
    if args.output:
        save_schedule(res.schedule, chain, args.output)
        print(f"wrote {args.output}")
    return 0


def _verified_line(verified: dict, limit: int) -> str:
    """What ``--verify`` measured of the schedule written, on one line."""
    over = verified["most_over"]
    again = (f", after {verified['rounds'] - 1} more solve(s), the last for {format_bytes(verified['solved_for_bytes'])}"
             if verified["rounds"] > 1 else "")
    moved, booked = verified.get("moved_bytes"), verified.get("booked_moved_bytes")  # (absent before they were)
    return (f"compiled and metered: peak {format_bytes(verified['measured_peak_bytes'])} within "
            f"{format_bytes(limit)}{again}; "
            + (f"{over['op']} held {format_bytes(over['bytes'])} over its prediction" if over else
               "every op within its prediction")
            + ("" if moved is None else f"; its copies move {format_bytes(moved)} each way, as booked" if moved == booked
               else "; " + copies_off([("each way", moved, booked)])))


def _unused_flags(args: argparse.Namespace) -> list[str]:
    """What the command line asks that this solve will not do, said rather than ignored."""
    notes = []
    searching = args.method in ("ilp", "relax-lp", "relax-bw")
    if args.recompute and not searching and args.method not in RECOMPUTING:
        notes.append(f"--recompute: {args.method} never recomputes (ilp and relax-* may; recompute-only and "
                     "checkpoint-* always do)")
    if args.max_run != 8 and not (searching and args.recompute) and args.method != "recompute-only":
        notes.append("--max-run: only ilp and relax-* with --recompute, and recompute-only, choose runs")
    if not args.in_stage and not (searching and args.recompute) and args.method != "recompute-only":
        notes.append("--no-in-stage: only ilp and relax-* with --recompute, and recompute-only, choose in-stage options")
    cores = os.cpu_count() or 1
    if args.threads is not None and args.threads > cores:
        notes.append(f"--threads {args.threads}: this machine has {cores} cores; the solver gains nothing past them")
    if args.threads is not None and args.method != "ilp":
        notes.append("--threads: only the ilp method's MILP solver runs threads")
    return notes


def _percent(share: float) -> str:
    """A gap as a percentage with two decimals, or two significant digits below 0.1%: a
    time-limited solve stopped at 0.0105% must not read "0.01%", the default proof tolerance."""
    return f"{100 * share:.2f}%" if share < 1e-7 or share >= 1e-3 else f"{100 * share:.2g}%"


def add_commands(sub: argparse._SubParsersAction, verified: Verified) -> None:
    """The solver's subcommands; ``verified`` solves and verifies a schedule compiled
    (``solve --verify``: the profiler's, which measures, handed in by ``offload.cli``)."""
    p = sub.add_parser("show", help="print a chain's stages, no-offload peak, ideal makespan, smallest budget",
                       description="Print a chain at a glance: its stage table, the no-offload activation peak, the "
                                   "ideal makespan and the smallest budget any schedule can meet.")
    p.add_argument("chain", type=input_path, help="chain.json")
    p.add_argument("--graphml", metavar="PATH", type=output_path, help="also export the chain graph (ops, units, edges) to GraphML")
    p.add_argument("--exact-floor", nargs="?", type=seconds(), const=10.0, metavar="SECONDS",
                   help="also bisect the smallest budget with recomputation with the joint MILP (a few solves of "
                        "SECONDS each, default 10; without it only a lower bound is printed)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("simulate", help="replay a schedule and print its makespan, stalls and peak",
                       description="Replay SCHEDULE on CHAIN with the simulator (the source of truth) and print the "
                                   "figures; refuses a schedule made for another chain or one that breaks its budget.")
    p.add_argument("chain", type=input_path, help="chain.json")
    p.add_argument("schedule", type=input_path, help="schedule.json (made for this chain)")
    p.add_argument("--budget", help="check against this budget instead of the schedule's own; " + BUDGET_HELP)
    p.add_argument("--total", action="store_true", help="--budget counts base_bytes (weights, grads, optimizer state)")
    p.add_argument("--timeline", action="store_true", help="print every op and copy with its times")
    p.add_argument("--json", action="store_true", help="print the full timeline as JSON")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("solve", help="compute a schedule under a memory budget",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Choose which activations to offload, when to release them and when to prefetch "
                                   "them, minimizing the step time under a memory budget.\n\n"
                                   "examples:\n"
                                   "  offload solve chain.json --budget 60% -o schedule.json\n"
                                   "  offload solve chain.json --budget 6GiB --total --method relax-lp\n"
                                   "  offload solve --list-methods\n\n"
                                   "Every schedule is replayed by the simulator before it is written. An impossible "
                                   "budget exits with status 4 and names the smallest feasible one; no file is written.")
    p.add_argument("chain", nargs="?", type=input_path, help="chain.json")
    p.add_argument("--budget", "-b", help=BUDGET_HELP)
    p.add_argument("--method", "-m", default="ilp", choices=list(METHODS), metavar="METHOD",
                   help="one of: " + ", ".join(METHODS) + " (default: ilp)")
    p.add_argument("--output", "-o", type=output_path, help="write the schedule here (atomically)")
    p.add_argument("--total", action="store_true", help="the budget counts base_bytes too (weights, grads, optimizer state)")
    p.add_argument("--encodings", choices=MODES, default="lossless", help=MODE_HELP + " (used by ilp, relax-*, gist*)")
    add_recompute_arguments(p)
    p.add_argument("--time-limit", type=seconds(), default=60.0, metavar="S",
                   help="wall time of the whole solve in seconds: heuristics, bounds, building and solving the MILP "
                        "(default 60); the best schedule found by then is returned, with its gap")
    p.add_argument("--gap", type=fraction, default=1e-4, help="ILP relative gap at which it stops, proven (default 1e-4)")
    p.add_argument("--threads", type=integer(1, 1024), default=None,
                   help="MILP solver threads (default: the solver's choice)")
    p.add_argument("--solver", choices=SOLVERS, default="highs", help="MILP solver for ilp (default highs)")
    p.add_argument("--heuristic-time", type=seconds(strict=False), default=1.0, metavar="S",
                   help="search time of each relax-* heuristic (default 1.0)")
    p.add_argument("--verbose", action="store_true", help="show the MILP solver's log")
    p.add_argument("--verify", action="store_true",
                   help="on a chain of the model compiled whole (profile --whole-graph): compile the schedule with "
                        "marks, meter a step op by op on the device the chain was profiled on, and solve again for "
                        "less where an op held more than the budget (a compile per solve, at most 4 solves)")
    p.add_argument("--list-methods", action="store_true", help="print the methods, one per line, and exit")
    p.set_defaults(func=cmd_solve, verified=verified)
