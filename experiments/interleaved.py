"""Schedules of one chain trained in alternate steps: each one's measured ratio to the first
beside the simulator's.

    python -m experiments.interleaved CHAIN SCHEDULE [SCHEDULE ...] [--rounds 12]

On a loaded machine two schedules timed one after the other can differ by the machine's
moods more than by their own costs.  Here the chain's model is built once from its recipe
(as ``offload train`` builds it), copied for each schedule, each copy wrapped in
``Offloaded`` with its schedule, and each round runs one step of every schedule in an order
rotated round by round (``Trainer.interleaved``): a schedule's ratio to the first is the
median of the rounds' ratios, which a slow moment shares.  The predicted ratio is the
simulator's makespan over the first schedule's: a measured ratio far from it is the model's
error, not the machine's (docs/model.md, "The host", names what a CPU's predictions leave
out).  No optimizer step: the weights stay, so every round trains the same step.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys

import torch

from offload.core.devices import pick_device
from offload.errors import OffloadError
from offload.executor import Offloaded
from offload.executor.train import build_like_chain
from offload.executor.trainer import Trainer, young_heap
from offload.io.text import format_seconds
from offload.step.chainfile import load_chain
from offload.step.schedulefile import load_schedule


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("chain")
    ap.add_argument("schedules", nargs="+", help="schedule files of the chain; the first is the reference")
    ap.add_argument("--rounds", type=int, default=12, help="rounds of one step of each schedule (default 12)")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except OffloadError as exc:  # a file that is missing, not a chain, or another chain's schedule
        print(f"experiments.interleaved: error: {exc}" + (f"\n  hint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return exc.exit_code


def _run(args: argparse.Namespace) -> int:
    chain = load_chain(args.chain)
    device = pick_device(args.device)
    spec = build_like_chain(chain, device)
    ways, predicted = {}, {}
    for path in args.schedules:
        schedule = load_schedule(path, chain)
        module = copy.deepcopy(spec.module)
        for p in module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        run = Offloaded(module, chain, schedule)
        ways[path] = ((lambda r: lambda a, k: r(*a, **k))(run), contextlib.nullcontext)
        predicted[path] = schedule.simulate(chain).makespan_s
    trainer = Trainer(spec, [], None, device)
    with young_heap():
        trainer.interleaved(ways, 1)  # the warm-up round: the host arenas, the allocator
        times, errors = trainer.interleaved(ways, args.rounds)
    first = args.schedules[0]
    print(f"{chain.name}: {args.rounds} rounds, one step of each schedule per round, order rotated")
    print("| schedule | predicted step | predicted ratio | measured step (median) | measured ratio (median of rounds) |")
    print("|---|---|---|---|---|")
    for path in args.schedules:
        if path in errors:
            print(f"| {path} | {format_seconds(predicted[path])} | | failed: {errors[path]} | |")
            continue
        ratio = statistics.median(a / b for a, b in zip(times[path], times[first]))
        print(f"| {path} | {format_seconds(predicted[path])} | {predicted[path] / predicted[first]:.3f} | "
              f"{format_seconds(statistics.median(times[path]))} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
