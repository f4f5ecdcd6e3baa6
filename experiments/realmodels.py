"""Models nobody on this project wrote, end to end: profile, solve at half the peak, train.

    python -m experiments.realmodels          # or: make realmodels (a few minutes on 2 CPU cores)
    python -m experiments.realmodels --set non-chains
    python -m experiments.realmodels --set decoders

``transformers`` (the default set): GPT-2, a Llama-style decoder, BERT and ViT from
transformers (small configs, random weights, dropout on, keyword inputs, the loss from
``output.loss``), and each with half its blocks frozen.  ``non-chains``: models whose block
boundaries several values cross (``tests/models/``): a transformers T5 (encoder-decoder), a
U-Net with skip connections, transformers' Mixtral (mixture of experts; and profiled with
``--split-blocks``, each layer's attention and sparse MoE block a stage), a frozen
backbone under a trainable head, and transformers' Whisper (a speech encoder-decoder: a
convolutional front end, every decoder block reading the encoder's output).  ``decoders``: transformers decoders the zoo does not build
(``tests/models/decoders.py``: Qwen3, GPT-NeoX, Gemma 2, Mamba), under bf16 autocast.  Each is profiled (``offload profile``), solved by the ILP
(with recomputation for the non-chains and the decoders, against offloading alone) at 50% of its no-offload
activation peak (halfway between its floor and its peak when its floor is higher; with
recomputation the joint floor, the least budget the joint MILP meets, bisected), and
trained 3 steps with ``--check-grads --op-memory`` on the lazy CPU backend.  One row per model in ``experiments/results/realmodels/<set>.csv``: stages, the
boundaries several values cross, the no-offload peak, the floor and its share (and the
joint floor's), predicted vs measured peak and step time, the largest difference of any
op's measured memory from its prediction, and grads_match.  On a CPU the step times include
the exact memory accounting; a GPU is where they mean something (``--device cuda``).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from offload.executor.train import TrainOptions, train
from offload.io.files import write_csv
from offload.io.text import format_bytes, format_seconds
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.floors import joint_floor
from offload.solver.methods import Options, solve
from offload.step.chainfile import save_chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget
from offload.step.schedulefile import save_schedule

OUT = Path(__file__).parent / "results" / "realmodels"
TRANSFORMERS = {
    "gpt2": {"layers": 8, "width": 128, "heads": 4, "seq": 256, "vocab": 512},
    "llama": {"layers": 8, "width": 128, "heads": 4, "kv_heads": 2, "seq": 256, "vocab": 512},
    "bert": {"layers": 6, "width": 128, "heads": 4, "seq": 256, "vocab": 512},
    "vit": {"layers": 8, "width": 96, "heads": 3, "image": 64, "patch": 4},
}
_MODELS = Path(__file__).resolve().parent.parent / "tests" / "models"
NON_CHAINS = {  # tag -> (model, options, blocks, --split-blocks)
    "t5": (f"{_MODELS / 't5.py'}:build", {"layers": 4, "width": 128, "seq": 128, "dropout": 0.1}, 8, False),
    "unet": (f"{_MODELS / 'unet.py'}:build", {"width": 16, "depth": 3, "image": 64}, 7, False),
    "mixtral": (f"{_MODELS / 'moe.py'}:build", {"layers": 4, "seq": 128}, 4, False),
    "mixtral-split": (f"{_MODELS / 'moe.py'}:build", {"layers": 4, "seq": 128}, 4, True),
    "frozen-backbone": (f"{_MODELS / 'frozen.py'}:build", {}, 3, False),
    "whisper": (f"{_MODELS / 'whisper.py'}:build", {"layers": 4, "width": 128, "frames": 256, "dropout": 0.1}, 8, False),
}


DECODERS = {"layers": 4, "width": 128, "seq": 64}  # tests/models/decoders.py, under bf16 autocast


def sets() -> dict[str, list[tuple[str, str, dict, int, int, bool, str | None]]]:
    """Per set, its runs: (tag, model, options, blocks, frozen blocks, --split-blocks, --autocast)."""
    transformers = [(m + (f"-frozen{f}" if f else ""), m, {**o, "frozen": f}, o["layers"], f, False, None)
                    for m, o in TRANSFORMERS.items() for f in (0, o["layers"] // 2)]
    return {"transformers": transformers,
            "non-chains": [(tag, m, o, n, 0, split, None) for tag, (m, o, n, split) in NON_CHAINS.items()],
            "decoders": [(arch, f"{_MODELS / 'decoders.py'}:build", {**DECODERS, "arch": arch}, DECODERS["layers"], 0,
                          False, "bfloat16") for arch in ("qwen3", "neox", "gemma2", "mamba")]}


def run(tag: str, model: str, options: dict, blocks: int, frozen: int, split: bool, autocast: str | None, batch: int,
        device: str | None, out: Path, recompute: bool = False) -> dict:
    t0 = time.perf_counter()
    prof = profile(model, ProfileOptions(batch=batch, device=device, repeats=3, options=options, split_blocks=split,
                                         autocast=autocast))
    chain = prof.chain
    save_chain(chain, out / f"{tag}-chain.json")
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain)
    joint = joint_floor(chain) if recompute else floor  # the least budget the joint MILP meets (0.5% of the peak)
    budget = int(0.5 * peak) if joint <= 0.5 * peak else joint + (peak - joint) // 2
    res = solve(chain, budget, "ilp", Options(time_limit_s=60, recompute=recompute))
    offload_only = res  # offloading alone, at the same budget: None where it cannot meet it
    if recompute:
        offload_only = solve(chain, budget, "ilp", Options(time_limit_s=60)) if budget >= floor else None
    save_schedule(res.schedule, chain, out / f"{tag}-schedule.json")
    backend = None if device == "cuda" else "cpu-lazy"
    report, error = train(None, chain, res.schedule, TrainOptions(steps=3, device=device, backend=backend,
                                                                   check_grads=True, op_memory=True))
    m, p = report.measured, report.predicted
    op_diff = max((abs(b - p.op_bytes[op]) for op, b in (m.op_peak_bytes or {}).items()), default=None)
    return {"model": tag, "blocks": blocks, "frozen_blocks": frozen, "stages": chain.L,
            "boundaries_crossed_by_several": len(chain.source.get("crossing", {})),
            "no_offload_peak_bytes": peak, "floor_bytes": floor, "floor_share": floor / peak,
            "joint_floor_share": joint / peak, "budget_bytes": budget,
            "budget_share": budget / peak, "recompute": recompute, "ilp_status": res.status,
            "recomputed_stages": sum(len(r.stages) for r in res.schedule.recompute),
            "offload_only_predicted_step_s": offload_only.simulation.makespan_s if offload_only else None, "predicted_peak_bytes": p.activation_peak_bytes,
            "measured_peak_bytes": m.activation_peak_bytes, "max_op_difference_bytes": op_diff,
            "predicted_step_s": p.step_s, "measured_step_s": m.step_s,
            "d2h_bytes": m.d2h_bytes_per_step, "grads_match": report.grads_match,
            "error": str(error) if error else "", "warnings": " | ".join(prof.warnings),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"results folder (default {OUT})")
    ap.add_argument("--set", choices=list(sets()), default="transformers", help="which models (default transformers)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run_args in sets()[args.set]:  # the transformers set without recomputation, the others with it
        rows.append(run(*run_args, args.batch, args.device, args.out, recompute=args.set != "transformers"))
        r = rows[-1]
        print(f"{r['model']:<16} {r['stages']:>3} stages  peak {format_bytes(r['no_offload_peak_bytes']):>10}  floor "
              f"{100 * r['floor_share']:5.1f}% (joint {100 * r['joint_floor_share']:4.1f}%)  budget {100 * r['budget_share']:4.0f}%  peak measured/predicted "
              f"{format_bytes(r['measured_peak_bytes'])}/{format_bytes(r['predicted_peak_bytes'])}  ops within "
              f"{r['max_op_difference_bytes']} B  step {format_seconds(r['measured_step_s'] or 0)}/"
              f"{format_seconds(r['predicted_step_s'])}  grads_match {r['grads_match']}", flush=True)
    name = "realmodels.csv" if args.set == "transformers" else f"{args.set}.csv"
    write_csv(args.out / name, rows)
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
