"""What taking held parts off the device buys: the ILP with and without restores, on one profile.

    python -m experiments.held_parts                       # about 1 minute here
    python -m experiments.held_parts --bandwidth 2GB/s     # a slower link, planned

The U-Net of ``tests/models/unet.py`` (its encoder's features concatenated by the decoder:
held by the model's code from the down block that makes them to the up block that reads
them), profiled once; at each budget (a share of the no-offload activation peak) ``ilp``
solves the chain as profiled, whose offloaded units may take their held parts off the
device until their reader (docs/model.md, "Held parts"), and the same chain without
``held_read_at``, where the held parts stay (the class before them).  Both predictions come
from the one profile, so their ratio is free of this machine's timing noise.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from experiments.moved_checkpoints import ilp_or_none
from experiments.reproduce import planned_link
from offload.io.text import format_bytes, format_seconds
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, Result
from offload.step.memory import no_offload_peak, smallest_feasible_budget


def _cell(result: Result | None) -> str:
    if result is None:
        return "nothing fits |"
    restored = sum(1 for o in result.schedule.offloads if o.restore)
    return (f"{format_seconds(result.simulation.makespan_s)} ({result.status}) | {len(result.schedule.offloads)} "
            f"offloaded, {restored} held parts restored")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--budgets", default="33,36,40,45,50", help="shares of the no-offload peak, %% (33,36,40,45,50)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="of each solve, seconds (30)")
    ap.add_argument("--recompute", action="store_true", help="the joint class (ilp --recompute)")
    planned_link(ap, "2GB/s")
    args = ap.parse_args(argv)
    options = {"width": args.width, "depth": args.depth, "image": args.image}
    chain = profile("tests/models/unet.py:build", ProfileOptions(batch=args.batch, repeats=3, warmup=1, encodings=False,
                                                                 options=options, platform=args.platform)).chain
    staying = replace(chain, stages=tuple(replace(s, held_saves=(), held_read_at=0) for s in chain.stages))
    peak = no_offload_peak(chain)
    held = ", ".join(f"U{i} {format_bytes(chain.stage(i).held_bytes)} read by F{chain.stage(i).held_read_at}"
                     for i in chain.restorable) or "none"
    print(f"U-Net batch {args.batch}, width {args.width}, depth {args.depth}, image {args.image}: {chain.L} stages; "
          f"link {chain.platform.d2h_bytes_per_s / 1e9:.3g} GB/s; held parts that may leave: {held}")
    print(f"smallest budget (offloading): {smallest_feasible_budget(chain) / peak:.1%} of the peak with restores, "
          f"{smallest_feasible_budget(staying) / peak:.1%} without")
    print("| budget | restores allowed: predicted step | schedule | held parts stay: predicted step | schedule | "
          "allowed / stay |")
    print("|---|---|---|---|---|---|")
    for share in (int(s) for s in args.budgets.split(",")):
        budget = peak * share // 100
        options = Options(time_limit_s=args.time_limit, recompute=args.recompute)
        ours, before = (ilp_or_none(c, budget, options) for c in (chain, staying))
        ratio = f"{ours.simulation.makespan_s / before.simulation.makespan_s:.3f}" if ours and before else "-"
        print(f"| {share}% | {_cell(ours)} | {_cell(before)} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
