"""Models nobody on this project wrote, compiled as one graph: does the compiled chain's budget hold?

    python -m experiments.compiled_models             # about 6 minutes on 2 CPU cores
    python -m experiments.compiled_models unet t5     # some of them
    python -m experiments.compiled_models --recompute --link 0.2   # recomputation offered, slow copies

Each model (transformers GPT-2, BERT and ViT, small configs, random weights; T5, a U-Net
with skip connections and Mixtral from ``tests/models``) is profiled compiled as one graph by
Inductor (``offload profile --compile inductor --whole-graph``), solved by the ILP halfway
between that chain's floor and its peak, and trained 2 steps by ``offload train`` (which runs
``compile_scheduled``) on the lazy CPU backend with ``--check-grads`` against the same
compile without the schedule (``plain_compile``) and ``--op-memory``.  One row per model:
stages, peak, floor, budget, units offloaded, the predicted and measured peak, whether the
budget held, how many saved values Inductor laid out otherwise than the graph (``relaid``:
each put back into the graph's layout in a device buffer no chain counts), the most an op
held over its prediction (``--op-memory``: a step of the schedule compiled again with the
profiler's marks, metered op by op), and the gradient check.  With ``--recompute`` the
profile offers recomputation where its compiles show the model follows it (eight more
compiles a model) and the ILP may choose it, the floor then the recompute floor; with
``--link`` the chain plans copies at that rate instead of this CPU's memory copies (so fast
that offloading always wins here; the executor still copies at its own pace, so only the
memory columns speak for the link).
"""
from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from experiments.bench_executor import machine_name
from offload.executor.train import TrainOptions, train
from offload.io.text import format_bytes
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step.chain import Platform
from offload.step.memory import no_offload_peak, smallest_feasible_budget

_MODELS = Path(__file__).resolve().parent.parent / "tests" / "models"
MODELS = {"gpt2": ("gpt2", {"layers": 4, "width": 64, "heads": 4, "seq": 64, "vocab": 128}),
          "bert": ("bert", {"layers": 3, "width": 64, "heads": 4, "seq": 64, "vocab": 128}),
          "vit": ("vit", {"layers": 3, "width": 48, "heads": 3, "image": 32, "patch": 4}),
          "t5": (f"{_MODELS / 't5.py'}:build", {"layers": 2, "width": 64, "seq": 32, "dropout": 0.1}),
          "unet": (f"{_MODELS / 'unet.py'}:build", {"width": 8, "depth": 2, "image": 32}),
          "mixtral": (f"{_MODELS / 'moe.py'}:build", {"layers": 2, "seq": 32})}


def row(tag: str, recompute: bool = False, link: float | None = None) -> str:
    model, options = MODELS[tag]
    t0 = time.perf_counter()
    platform = Platform(link * 1e9, link * 1e9, note=f"{link} GB/s, given") if link else None
    chain = profile(model, ProfileOptions(batch=2, repeats=2, warmup=1, encodings=False, options=options,
                                          compile="inductor", whole_graph=True, recompute=recompute,
                                          platform=platform)).chain
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain, recompute=recompute)
    budget = floor + (peak - floor) // 2
    schedule = solve(chain, budget, "ilp", Options(time_limit_s=20, recompute=recompute)).schedule
    predicted = schedule.simulate(chain).peak_bytes
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, error = train(None, chain, schedule, TrainOptions(steps=2, backend="cpu-lazy", check_grads=True,
                                                                  op_memory=True))
    relaid = sum("laid out a saved value of the compiled graph" in str(w.message) for w in caught)
    ops, predicted_ops = report.measured.op_peak_bytes or {}, report.predicted.op_bytes or {}
    op = max(predicted_ops, key=lambda o: ops.get(o, 0) - predicted_ops[o])
    over = ops.get(op, 0) - predicted_ops[op]
    measured = report.measured.activation_peak_bytes
    held = measured is not None and measured <= budget
    grads = ("bit for bit" if report.grads_match else "within noise" if report.grads_within_noise else
             f"differ ({max(report.grad_rel_diff or [0]):.1e} relative)")
    return (f"| {tag} | {chain.L} | {format_bytes(peak)} | {format_bytes(floor)} ({floor / peak:.0%}) | "
            f"{format_bytes(budget)} | {len(schedule.offloads)} | "
            f"{f'{len(chain.recomputable)}: {[r.text for r in schedule.recompute]} | ' if recompute else ''}"
            f"{format_bytes(predicted)} | "
            f"{format_bytes(measured) if measured is not None else '-'} | {'yes' if held else 'NO'} | "
            f"{'yes' if relaid else 'no'} | {format_bytes(over)} ({op}) | {grads} | {time.perf_counter() - t0:.0f} s |"
            + (f" {str(error)[:80]}" if error and not held else ""))


def model_parser(description: str) -> argparse.ArgumentParser:
    """A command line of an experiment on ``MODELS``: the models it is asked for (``chosen``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("models", nargs="*", metavar="MODEL", help=f"some of {', '.join(MODELS)} (default: all)")
    return ap


def chosen(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The models ``args`` name (all by default); an unknown one stops ``ap`` with its name."""
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}: choose from {', '.join(MODELS)}")
    return args.models or list(MODELS)


def chosen_models(argv: list[str] | None, description: str) -> list[str]:
    """The models an experiment on ``MODELS`` is asked for on its command line (all by default)."""
    ap = model_parser(description)
    return chosen(ap, ap.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    ap = model_parser(__doc__.splitlines()[0])
    ap.add_argument("--recompute", action="store_true",
                    help="offer recomputation (eight more compiles a model) and let the ILP choose it")
    ap.add_argument("--link", type=float, metavar="GB_PER_S",
                    help="plan copies at this rate each way (e.g. 0.2) instead of this CPU's memory copies")
    args = ap.parse_args(argv)
    models = chosen(ap, args)
    print(f"{machine_name('cpu')}; batch 2; 2 steps of offload train each"
          + (f"; copies planned at {args.link} GB/s" if args.link else ""))
    print("| model | stages | peak | floor | budget | offloaded | " + ("offered: recomputed | " if args.recompute else "")
          + "predicted peak | measured peak | budget held | relaid | largest op over its prediction | gradients | time |")
    print("|" + "---|" * (13 + args.recompute))
    for tag in models:
        try:
            print(row(tag, args.recompute, args.link), flush=True)
        except Exception as exc:  # a model the path cannot take: its row says why
            print(f"| {tag} | failed: {type(exc).__name__}: {str(exc)[:160]} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
