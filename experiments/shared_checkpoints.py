"""What counting a checkpoint's shared storages once costs the solver and buys the schedule.

    python -m experiments.shared_checkpoints --bandwidth 0.5GB/s   # about 3 minutes here

A ResNet-50 (batch 8, image 128), profiled once.  A block's output, saved by its last ReLU
in the block's unit, is the next block's input: a run starting at the next block holds it
as its checkpoint, one storage (``input_prev_bytes``, ``input_prev_held_bytes``; docs/model.md,
"Recomputation").  At each budget (a share of the no-offload activation peak) ``ilp
--recompute`` solves the chain as profiled and the same chain with those fields zeroed,
where the checkpoint counts beside the unit (the model before them); each row gives both
predicted steps, the solver's status and its wall time.  The link is planned
(``--bandwidth``): at this CPU's measured copy rate offloading hides everything and nothing
is recomputed.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

from experiments.moved_checkpoints import ilp_or_none
from experiments.reproduce import planned_link
from offload.io.text import format_seconds
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options
from offload.step.chain import Chain
from offload.step.memory import no_offload_peak


def _solved(chain: Chain, budget: int, options: Options) -> str:
    start = time.perf_counter()
    result = ilp_or_none(chain, budget, options)
    took = time.perf_counter() - start
    if result is None:
        return f"nothing fits | {took:.1f} s"
    return f"{format_seconds(result.simulation.makespan_s)} ({result.status}) | {took:.1f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50", help="a zoo model (resnet50)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=128)
    ap.add_argument("--budgets", default="34,36,38,40,45,50", help="shares of the no-offload peak, %% (34,...,50)")
    ap.add_argument("--time-limit", type=float, default=120.0, help="of each solve, seconds (120)")
    planned_link(ap, "0.5GB/s")
    args = ap.parse_args(argv)
    chain = profile(args.model, ProfileOptions(batch=args.batch, repeats=2, warmup=1, encodings=False,
                                               options={"image": args.image}, platform=args.platform)).chain
    apart = replace(chain, stages=tuple(replace(s, input_prev_bytes=0, input_prev_held_bytes=0) for s in chain.stages))
    shared = sum(1 for s in chain.stages if s.input_prev_bytes)
    peak = no_offload_peak(chain)
    print(f"{args.model}, batch {args.batch}, image {args.image}: {chain.L} stages, {shared} checkpoints sharing "
          f"storages with the unit before; link {chain.platform.d2h_bytes_per_s / 1e9:.3g} GB/s")
    print("| budget | counted once: predicted step | solve | counted twice: predicted step | solve |")
    print("|---|---|---|---|---|")
    joint = Options(recompute=True, time_limit_s=args.time_limit)
    for share in (int(s) for s in args.budgets.split(",")):
        budget = peak * share // 100
        print(f"| {share}% | {_solved(chain, budget, joint)} | {_solved(apart, budget, joint)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
