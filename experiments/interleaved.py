"""Schedules of one chain trained in alternate steps: each one's measured ratio to the first
beside the simulator's.

    python -m experiments.interleaved CHAIN SCHEDULE [SCHEDULE ...] [--rounds 12]

On a loaded machine two schedules timed one after the other can differ by the machine's
moods more than by their own costs.  Here the chain's model is built once from its recipe
(as ``offload train`` builds it), copied for each schedule (the copies sharing its
weights), each copy wrapped in ``Offloaded`` with its schedule, and each round runs one step of every schedule in an order
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
from typing import Any, Callable

import torch

from offload.core.devices import pick_device
from offload.errors import OffloadError
from offload.executor import Offloaded
from offload.executor.train import build_like_chain
from offload.executor.trainer import Trainer, young_heap
from offload.io.text import format_seconds
from offload.step.chain import Chain
from offload.step.chainfile import load_chain
from offload.step.schedule import Schedule
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


def interleave_schedules(chain: Chain, schedules: list[Schedule], rounds: int, device: torch.device
                         ) -> tuple[list[list[float]], dict[int, OffloadError]]:
    """``rounds`` rounds of one step of each schedule, after a warm-up round, the order rotated
    each round (``Trainer.interleaved``), each on its own copy of the chain's model (built from
    its recipe) under ``Offloaded``, the copies sharing one set of weights and buffers: no
    optimizer, the gradients zeroed between steps, so every round trains the same step.

    Returns:
        Each schedule's step times, in round order, and the error of a schedule that failed
        (by its place in ``schedules``)."""
    spec = build_like_chain(chain, device)
    shared = {id(t): t for t in [*spec.module.parameters(), *spec.module.buffers()]}
    params = [p for p in spec.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None if spec.set_to_none else torch.zeros_like(p)
    ways = {str(n): (_forward(Offloaded(copy.deepcopy(spec.module, memo=dict(shared)), chain, schedule)),
                     contextlib.nullcontext) for n, schedule in enumerate(schedules)}
    trainer = Trainer(spec, params, None, device)
    with young_heap():
        trainer.interleaved(ways, 1)  # the warm-up round: the host arenas, the allocator
        times, errors = trainer.interleaved(ways, rounds)
    return [times[str(n)] for n in range(len(schedules))], {int(n): e for n, e in errors.items()}


def _forward(run: Offloaded) -> Callable[[tuple, dict], Any]:
    return lambda args, kwargs: run(*args, **kwargs)


def _run(args: argparse.Namespace) -> int:
    chain = load_chain(args.chain)
    schedules = [load_schedule(path, chain) for path in args.schedules]
    predicted = [schedule.simulate(chain).makespan_s for schedule in schedules]
    times, errors = interleave_schedules(chain, schedules, args.rounds, pick_device(args.device))
    print(f"{chain.name}: {args.rounds} rounds, one step of each schedule per round, order rotated")
    print("| schedule | predicted step | predicted ratio | measured step (median) | measured ratio (median of rounds) |")
    print("|---|---|---|---|---|")
    for n, path in enumerate(args.schedules):
        if n in errors:
            print(f"| {path} | {format_seconds(predicted[n])} | | failed: {errors[n]} | |")
            continue
        ratios = [a / b for a, b in zip(times[n], times[0])]  # none where the first failed at once
        print(f"| {path} | {format_seconds(predicted[n])} | {predicted[n] / predicted[0]:.3f} | "
              f"{format_seconds(statistics.median(times[n]))} | "
              + (f"{statistics.median(ratios):.3f} |" if ratios else "- |"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
