"""Random joint schedules on real models: does every op hold what the simulator says it holds?

    python -m experiments.op_memory_sweep                        # seven zoo models, 25 schedules each: ~3 minutes
    python -m experiments.op_memory_sweep --models resnet18,gpt2 --trials 5 --seed 3

Each model is profiled once, at a tiny size, on the CPU (whose meter is exact per op); then
``--trials`` schedules are drawn: each re-runnable stage starts a recomputed run with
probability 0.4, the run goes on with probability 0.5 while its stages rebuild their outputs,
and of the other units each is offloaded at once (released after the next forward, fetched
on demand) with probability 0.5.  Each schedule trains one step with the gradient check and
the per-op memory reading (``offload train --check-grads --op-memory``).  Per model the table
gives the schedules tried, how many had an op *over* its prediction (a defect of the model:
docs/model.md, "Memory"; the largest excess with its schedule is printed below the table),
the ops *under* theirs (what the model books conservatively: a checkpoint whose storage an
earlier unit holds too, counted twice), and the gradient mismatches.  It exits 1 when any
schedule had an op over its prediction or gradients that differ.
"""
from __future__ import annotations

import argparse
import random

from offload.executor.train import TrainOptions, train
from offload.profiler.profile import ProfileOptions, profile
from offload.step.actions import Offload, Recompute
from offload.step.chain import Chain
from offload.step.memory import floor_offloads
from offload.step.schedule import make_schedule

MODELS = {  # zoo model -> options small enough for the CPU
    "densenet121": {"image": 32}, "resnet18": {"image": 32}, "inception": {"image": 64},
    "gpt2": {"layers": 3, "width": 64, "seq": 16}, "llama": {"layers": 3, "width": 64, "seq": 16},
    "vit": {"layers": 2, "width": 48, "image": 32}, "convnext": {"width": 16, "image": 32},
}


def draw(chain: Chain, rnd: random.Random) -> tuple[list[Offload], list[Recompute]]:
    """One random schedule of the joint class (module doc)."""
    runs, i = [], 1
    while i < chain.L:
        if i in chain.recomputable and rnd.random() < 0.4:
            last = i
            while last + 1 in chain.recomputable and chain.stage(last).rerun_output and rnd.random() < 0.5:
                last += 1
            runs.append(Recompute(i, last))
            i = last + 2  # runs do not touch: a stage between them keeps the first one's output
        else:
            i += 1
    rebuilt = {k for r in runs for k in r.stages}
    offloads = [o for o in floor_offloads(chain, runs) if o.stage not in rebuilt and rnd.random() < 0.5]
    return offloads, runs


def _text(offloads: list[Offload], runs: list[Recompute]) -> str:
    return (f"recompute {', '.join(f'{r.first}-{r.last}' for r in runs) or 'none'}; "
            f"offload {', '.join(str(o.stage) for o in offloads) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated ({','.join(MODELS)})")
    ap.add_argument("--trials", type=int, default=25, help="schedules per model (25)")
    ap.add_argument("--seed", type=int, default=0, help="of the schedules drawn (0)")
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    print("| model | stages | schedules | with an op over | ops under (largest) | gradients differ |")
    print("|---|---:|---:|---:|---|---:|")
    worst: list[str] = []
    mismatched = 0
    for name in args.models.split(","):
        chain = profile(name, ProfileOptions(batch=args.batch, repeats=1, warmup=1, encodings=False,
                                             options=MODELS.get(name, {}))).chain
        over_runs = differ = under_ops = under_most = 0
        most: tuple[int, str] = (0, "")
        for _ in range(args.trials):
            offloads, runs = draw(chain, rnd)
            report, error = train(name, chain, make_schedule(chain, offloads, recompute=runs),
                                  TrainOptions(steps=1, check_grads=True, op_memory=True))
            measured, predicted = report.measured.op_peak_bytes or {}, report.predicted.op_bytes
            over = {op: measured[op] - predicted[op] for op in predicted if measured.get(op, 0) > predicted[op]}
            under = [predicted[op] - measured[op] for op in predicted if measured.get(op, predicted[op]) < predicted[op]]
            under_ops, under_most = under_ops + len(under), max([under_most, *under])
            differ += error is not None or report.grads_match is not True
            if over:
                over_runs += 1
                op = max(over, key=over.get)
                most = max(most, (over[op], f"{name}: {op} {over[op]} B over ({_text(offloads, runs)})"))
        if most[1]:
            worst.append(most[1])
        mismatched += differ
        print(f"| {name} | {chain.L} | {args.trials} | {over_runs} | {under_ops} ({under_most} B) | {differ} |", flush=True)
    for line in worst:
        print(line)
    return 1 if worst or mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
