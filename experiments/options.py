"""In-stage options against activation checkpointing (issue #33): a bf16 Llama, budgets 20–70%.

    python -m experiments.options --bandwidth 0.5GB/s   # profile, solve, train: about 18 minutes here
    python -m experiments.options --no-train            # predictions only, a few minutes

``make bench`` runs the first (experiments/results/README.md has its table).
A transformers Llama (SwiGLU, RoPE, GQA, SDPA attention with dropout 0.1) in bf16 autocast,
profiled once.  Each method solves for each budget (a share of the no-offload activation
peak); each schedule that fits is trained (``offload train --check-grads``) and its
measured step and activation peak printed beside the prediction:

* ``none``: no offloading, at the peak (the step everything is compared with);
* ``checkpoint-blocks``: per-block ``torch.utils.checkpoint``, on our executor;
* ``checkpoint-matmuls``: op-level selective checkpointing (torchtitan's "save the
  matmuls"), each block's ``matmuls`` in-stage option, on our executor; the same policy
  run by ``torch.utils.checkpoint`` with a selective-checkpoint policy, and plain PyTorch,
  are measured once (``train --compare``) as users run them: they keep autocast's weight
  casts for the backward, which our schedules make again (docs/model.md, "Weight casts"),
  so their peaks hold the casts (21 MiB a block at width 1024) and ours do not;
* ``checkpoint-every-other-matmul``: torchtitan's default op policy, each block's
  ``every-other-matmul`` option (every second matmul re-run too), on our executor;
* ``checkpoint-blocks-offload`` and ``checkpoint-matmuls-offload``: the same two policies
  with torchtune's ``OffloadActivations`` around them, as users combine them today: each
  block's checkpoint (its input, and the kept matmul outputs) offloaded as soon as that
  frees it, fetched one op ahead of its rebuild (docs/model.md, "Offloaded checkpoints");
* ``recompute-only``: the optimal schedule that only recomputes (``--no-in-stage``: whole
  stages), and ``recompute-only + options``, which may also re-run a stage in part; no
  copies, so a CPU measures them as a GPU would order them;
* ``joint per-block``: ``ilp --recompute --no-in-stage``, each stage kept, offloaded or
  recomputed whole (its checkpoint kept or offloaded);
* ``joint + options``: ``ilp --recompute``, which may also re-run a stage in part and
  offload what the option keeps with its checkpoint.

It prints the smallest budget the joint ILP meets with the options and per block (each
bisected to 0.5% of the peak). The fixed policies have one peak whatever the budget: they are listed at every budget
their peak fits.  A step's noise is the spread (largest less smallest over the median) of
its timed steps, printed per row.  Runs minutes apart differ by more than that on a loaded
machine (10% on the 2-core development machine), so the verdict "ours ≤ baseline within
noise" is not judged from the separate runs: after them, every row of a budget trains
again on one process, one step of each row in turn (``--rounds`` rounds, the order rotated
each round, the rows' modules sharing one set of weights), and each round's step of ours
is divided by the same round's step of each other row.  Ours is at or below a row within
noise when the median of those paired ratios is at most 1 plus half their interquartile
range (or runs the same schedule as ours: two rows whose methods chose the same actions
measure nothing but the noise against each other); the table after the verdicts prints the
medians and ranges.  The no-offload schedule trains in those rounds too, and a last table
sets each row's step over its step, the median of the rounds' ratios, beside the
simulator's ratio: the model's error at the run's pace, which a machine slower or faster
than during the profile does not move.  On a CPU the copies are memcpy on the cores that
compute, so schedules that offload are measured on a stand-in link; the recompute-only rows
are what this machine can judge.

"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field, replace

import torch

from experiments.interleaved import interleave_schedules
from experiments.reproduce import planned_link
from offload.errors import InfeasibleBudget
from offload.executor.train import TrainOptions, train
from offload.io.text import format_bytes, format_seconds
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.floors import joint_floor
from offload.solver.methods import Options, Result, solve
from offload.step.chain import Chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget

FIXED = ("checkpoint-blocks", "checkpoint-matmuls", "checkpoint-every-other-matmul", "checkpoint-blocks-offload",
         "checkpoint-matmuls-offload")
SEARCHED = (("recompute-only", "recompute-only", False), ("recompute-only + options", "recompute-only", True),
            ("joint per-block", "ilp", False), ("joint + options", "ilp", True))  # (row, method, in-stage options)


@dataclass
class Row:
    """One schedule: what it predicts and, trained, what it measured."""

    method: str
    result: Result
    step_s: float | None = None
    spread: float | None = None
    peak: int | None = None
    grads: str = "-"
    error: str | None = None
    rounds: list[float] = field(default_factory=list)  # its step in each interleaved round (``interleave``)

    @property
    def predicted_s(self) -> float:
        return self.result.simulation.makespan_s


def measure(chain: Chain, row: Row, args: argparse.Namespace, compare: bool = False) -> dict:
    """Train ``row``'s schedule, gradients checked; fill in what it measured (and return the
    ``--compare`` baselines, if asked)."""
    report, error = train(None, chain, row.result.schedule,
                          TrainOptions(steps=args.steps, check_grads=True, compare=compare))
    m = report.measured
    times = m.step_times_s
    row.step_s, row.peak, row.error = m.step_s, m.activation_peak_bytes, error
    row.spread = (max(times) - min(times)) / m.step_s if times and m.step_s else None
    row.grads = {True: "bit for bit", False: "DIFFER", None: "-"}[report.grads_match]
    return report.compare or {}


def interleave(chain: Chain, rows: list[Row], rounds: int) -> None:
    """Train ``rows``' schedules one step each in turn, ``rounds`` times after a warm-up round
    (``experiments.interleaved.interleave_schedules``: the order rotated each round, on copies
    of one module sharing its weights); each row's step per round into ``row.rounds``."""
    times, errors = interleave_schedules(chain, [row.result.schedule for row in rows], rounds, torch.device("cpu"))
    if errors:
        raise next(iter(errors.values()))
    for row, took in zip(rows, times):
        row.rounds.extend(took)


def paired(ours: Row, other: Row) -> tuple[float, float, float]:
    """The median of ``ours``' step over ``other``'s, round by round, and the ratios' quartiles."""
    ratios = [a / b for a, b in zip(ours.rounds, other.rounds)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), q1, q3


def line(peak: int, budget: str, row: Row, planned_link: bool) -> str:
    pred = row.result.simulation
    measured = (f"{format_seconds(row.step_s)} ±{100 * row.spread:.0f}% | {format_bytes(row.peak)} "
                f"({100 * row.peak / peak:.0f}%) | {100 * (row.step_s / row.predicted_s - 1):+.1f}% | {row.grads}"
                if row.step_s else "| | | " if row.error is None else f"failed: {row.error} | | |")
    runs = pred.recompute
    what = (f"{sum(1 for r in runs if r.option)} in part, {sum(1 for r in runs if not r.option)} whole "
            f"({sum(1 for r in runs if r.moves)} checkpoints offloaded), {len(pred.offloads)} offloaded; "
            f"{row.result.status}"
            + ("; link planned, copies measured at memcpy speed" if planned_link and pred.copies else ""))
    return (f"| {budget} | {row.method} | {format_seconds(row.predicted_s)} | {format_bytes(pred.peak_bytes)} "
            f"({100 * pred.peak_bytes / peak:.0f}%) | {measured} | {what} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--width", type=int, default=1024, help="(1024: on a CPU, smaller blocks get no option)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--budgets", default="20,30,40,50,60,70", help="shares of the no-offload peak, %% (20,...,70)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps of the profile (3)")
    ap.add_argument("--steps", type=int, default=4, help="steps of each training run (4)")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds of a budget's rows for the verdict (8)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="of each solve, seconds (30)")
    planned_link(ap, "0.5GB/s", "; on a CPU the copies still run at memcpy speed, so the measured steps of schedules "
                                "that offload are not this link's")
    ap.add_argument("--no-train", dest="train", action="store_false", help="predictions only")
    args = ap.parse_args(argv)
    options = {"layers": args.layers, "width": args.width, "heads": 8, "kv_heads": 2, "seq": args.seq,
               "vocab": 1000, "dropout": 0.1}
    chain = profile("llama", ProfileOptions(batch=args.batch, repeats=args.repeats, warmup=1, autocast="bfloat16",
                                            options=options, platform=args.platform)).chain
    peak = no_offload_peak(chain)
    print(f"Llama {args.layers} layers, width {args.width}, sequence {args.seq}, batch {args.batch}, bf16 autocast, "
          f"SDPA, attention dropout 0.1; {torch.get_num_threads()} threads, torch {torch.__version__}; link "
          f"{chain.platform.d2h_bytes_per_s / 1e9:.3g} GB/s"
          + (" (planned for, not this machine's)" if args.platform else ""))
    print(f"no-offload activation peak {format_bytes(peak)}; smallest budget with recomputation no lower than "
          f"{100 * smallest_feasible_budget(chain, recompute=True) / peak:.1f}% (a bound, options or not)")
    floors = {name: joint_floor(c, args.time_limit) for name, c in (("options", chain),
                                                                    ("per block", chain.without_options()))}
    print("smallest budget the joint ILP meets (bisected to 0.5%): " + ", ".join(
        f"{100 * b / peak:.1f}% {name}" for name, b in floors.items()))
    for i, name in chain.optional:
        s, o = chain.stage(i), chain.stage(i).option(name)
        print(f"  stage {i} {s.name}: {name} keeps {format_bytes(o.kept_bytes)} of {format_bytes(s.saved_bytes)}, "
              f"re-runs {format_seconds(o.recompute_s)} of {format_seconds(s.fwd_s)}")
    opts = Options(recompute=True, time_limit_s=args.time_limit)
    reference = Row("none", solve(chain, peak, "none", opts))
    fixed = [Row(name, solve(chain, 2 * peak, name, opts)) for name in FIXED]
    torch_sac = {}
    if args.train:
        measure(chain, reference, args)
        for row in fixed:
            torch_sac = measure(chain, row, args, compare=row.method == "checkpoint-matmuls") or torch_sac
    print()
    print("| budget | method | predicted step | predicted peak | measured step ± spread | measured peak | measured / "
          "predicted | gradients | schedule |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(line(peak, "100%", reference, False), flush=True)
    for key, name in (("no_offload", "plain PyTorch"), ("selective_checkpoint", "SAC by torch.utils.checkpoint")):
        base = torch_sac.get(key)  # as users run it: the weight casts saved for the backward, which ours make again
        if base is not None:
            print(f"| | {name} (--compare; its weight casts kept) | | | "
                  + (f"{format_seconds(base.step_s)} | {format_bytes(base.activation_peak_bytes)} "
                     f"({100 * base.activation_peak_bytes / peak:.0f}%) | | | |" if base.step_s
                     else f"failed: {base.error} | | | | |"))
    verdicts, pairs, errors = [], [], []
    for share in (int(s) for s in args.budgets.split(",")):
        budget = peak * share // 100
        rows = [r for r in fixed if r.result.simulation.peak_bytes <= budget]
        for name, method, in_stage in SEARCHED:
            try:
                rows.append(Row(name, solve(chain, budget, method, replace(opts, in_stage=in_stage))))
            except InfeasibleBudget:
                print(f"| {share}% | {name} | nothing fits | | | | | | |")
        for row in rows:
            if args.train and row.method not in FIXED:
                measure(chain, row, args)
            print(line(peak, f"{share}%", row, args.platform is not None), flush=True)
        trained = [r for r in rows if r.step_s is not None]
        if args.train and any(r.method == "joint + options" for r in trained) and len(trained) > 1:
            plain = Row("none", reference.result)  # the no-offload step in the same rounds: the pace
            interleave(chain, trained + [plain], args.rounds)
            errors += [_error(share, r, plain) for r in trained]
        verdict, lines = _verdict(share, rows)
        verdicts.append(verdict)
        pairs += lines
    print()
    print("\n".join(verdicts))
    if pairs:
        print()
        print(f"Interleaved ({args.rounds} rounds): joint + options' step over each row's, the same round")
        print()
        print("| budget | row | median ratio | interquartile range | within noise |")
        print("|---|---|---|---|---|")
        print("\n".join(pairs))
    if errors:
        print()
        print(f"The model's error at this run's pace: each row's step over the no-offload schedule's in the same "
              f"round ({args.rounds} rounds), beside the simulator's ratio")
        print()
        print("| budget | row | predicted ratio | measured ratio (median) | error |")
        print("|---|---|---|---|---|")
        print("\n".join(errors))
    return 0


def _error(share: int, row: Row, plain: Row) -> str:
    """A table line: ``row``'s step over the no-offload schedule's, predicted and measured (the
    median of the interleaved rounds' ratios, which the machine's pace does not move)."""
    predicted = row.predicted_s / plain.predicted_s
    measured = statistics.median(a / b for a, b in zip(row.rounds, plain.rounds))
    return f"| {share}% | {row.method} | {predicted:.3f} | {measured:.3f} | {100 * (measured / predicted - 1):+.1f}% |"


def _verdict(share: int, rows: list[Row]) -> tuple[str, list[str]]:
    """Whether ``joint + options`` is predicted, and measured within noise (interleaved, paired
    round by round), at or below every other row; and a table line per pair."""
    ours = next((r for r in rows if r.method == "joint + options"), None)
    if ours is None:
        return f"{share}%: nothing of ours fits", []
    others = [r for r in rows if r is not ours]
    predicted = all(ours.predicted_s <= r.predicted_s * (1 + 1e-9) for r in others)
    unproven = "" if predicted or ours.result.status == "optimal" else \
        f" (the ILP stopped at its time limit, {ours.result.status}: give it more with --time-limit)"
    said, lines, over = f"{share}%: predicted ≤ every other: {predicted}{unproven}", [], []
    for r in others:
        if ours.rounds and r.rounds:
            median, q1, q3 = paired(ours, r)
            same = _actions(r) == _actions(ours)  # the same program twice: what it measures is the noise alone
            within = same or median <= 1 + (q3 - q1) / 2
            lines.append(f"| {share}% | {r.method} | {median:.3f} | {q1:.3f}-{q3:.3f} | {within}"
                         + (" (the same schedule)" if same else "") + " |")
            if not within:
                over.append(r.method)
    if lines:
        said += f"; measured ≤ every other within noise (interleaved): {not over}" + (
            f" (not: {', '.join(over)})" if over else "")
    return said, lines


def _actions(row: Row) -> tuple:
    """What a row's schedule does (its offloads, encodings, recomputation and kept casts)."""
    sched = row.result.schedule
    return sched.offloads, tuple(sorted(sched.encode.items())), sched.recompute, sched.casts_kept


if __name__ == "__main__":
    raise SystemExit(main())
