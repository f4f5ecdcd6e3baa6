"""What offloaded checkpoints buy: the joint ILP with and without them, on one profile.

    python -m experiments.moved_checkpoints --bandwidth 0.5GB/s   # about 4 minutes here

The bf16 Llama of ``experiments.options`` (10 layers, width 1024, sequence 128, batch 2,
SDPA, attention dropout 0.1), profiled once; at each budget (a share of the no-offload
activation peak) ``ilp --recompute`` solves the chain as profiled, whose recomputed blocks
may offload their checkpoints (docs/model.md, "Offloaded checkpoints"), and the same chain
without ``input_own_bytes``, where every checkpoint stays on the device (the class before
them). Both predictions come from the one profile, so their ratio is this machine's
timing noise free; the link is planned (``--bandwidth``), as in ``experiments.options``.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from experiments.reproduce import planned_link
from offload.errors import InfeasibleBudget
from offload.io.text import format_seconds
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, Result, solve
from offload.step.chain import Chain
from offload.step.memory import no_offload_peak


def _cell(result: Result | None) -> str:
    if result is None:
        return "nothing fits |"
    runs = result.schedule.recompute
    return (f"{format_seconds(result.simulation.makespan_s)} ({result.status}) | {len(runs)} recomputed, "
            f"{sum(r.moves for r in runs)} checkpoints offloaded, {len(result.schedule.offloads)} units offloaded")


def ilp_or_none(chain: Chain, budget: int, options: Options) -> Result | None:
    """The ILP's result for ``budget``, or ``None`` where nothing fits (a table's empty cell)."""
    try:
        return solve(chain, budget, "ilp", options)
    except InfeasibleBudget:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--budgets", default="30,35,40,50", help="shares of the no-offload peak, %% (30,35,40,50)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="of each solve, seconds (30)")
    planned_link(ap, "0.5GB/s")
    args = ap.parse_args(argv)
    options = {"layers": args.layers, "width": args.width, "heads": 8, "kv_heads": 2, "seq": 128, "vocab": 1000,
               "dropout": 0.1}
    chain = profile("llama", ProfileOptions(batch=2, repeats=3, warmup=1, autocast="bfloat16", options=options,
                                            platform=args.platform)).chain
    kept = replace(chain, stages=tuple(replace(s, input_own_bytes=0) for s in chain.stages))
    peak = no_offload_peak(chain)
    print(f"Llama {args.layers} layers, width {args.width}, bf16; link {chain.platform.d2h_bytes_per_s / 1e9:.3g} GB/s")
    print("| budget | checkpoints may move: predicted step | schedule | checkpoints kept: predicted step | schedule | "
          "moved / kept |")
    print("|---|---|---|---|---|---|")
    for share in (int(s) for s in args.budgets.split(",")):
        budget = peak * share // 100
        joint = Options(recompute=True, time_limit_s=args.time_limit)
        moved, still = ilp_or_none(chain, budget, joint), ilp_or_none(kept, budget, joint)
        ratio = (f"{moved.simulation.makespan_s / still.simulation.makespan_s:.3f}" if moved and still else "-")
        print(f"| {share}% | {_cell(moved)} | {_cell(still)} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
