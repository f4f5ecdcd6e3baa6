"""Weight casts under autocast (issue #36): the issue's table, rerun.

    python -m experiments.casts                  # the issue's Qwen2, about a minute here
    python -m experiments.casts --train          # and train both schedules, gradients checked

A transformers Qwen2 built from its config (6 layers, width 128, SwiGLU 512, 4 heads, 2
key/value heads, attention dropout 0.1, tied embeddings; batch 2, sequence 128), profiled
three ways: fp32 with ``use_cache=False``; bf16 autocast with ``use_cache=False``; bf16
autocast with the config's default ``use_cache=True`` (the profiler turns it off for
training and says so).  Per way: how many blocks may be recomputed, the first and last
decoder layer's forward and backward transients (they grew with depth while the casts
were saved), the smallest feasible budget, the casts' bytes, per-block checkpointing's
step and peak, and the joint schedule (``ilp --recompute``) at that same peak: its step,
how far below checkpointing's, and in how many stages it keeps the casts.  With
``--train`` both schedules are trained (``offload train --check-grads --op-memory``, the
joint one with ``--compare``, which also measures op-level selective checkpointing, "SAC
(matmuls)", at its own peak): on a CPU the measured steps compare them, the prediction of
the one that moves units is loose there (the copies are memcpy on the cores that compute).
"""
from __future__ import annotations

import argparse

import torch

from offload.executor.train import TrainOptions, train
from offload.io.text import format_bytes, format_seconds
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step.memory import no_offload_peak, smallest_feasible_budget

WAYS = (("fp32, use_cache=False", None, 0), ("bf16, use_cache=False", "bfloat16", 0),
        ("bf16, config default (use_cache=True)", "bfloat16", -1))


def qwen2(batch: int, layers: int = 6, seq: int = 128, cache: int = -1):
    """The issue's Qwen2 (``cache``: 0 or 1 sets ``use_cache``, -1 keeps the config's default)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, tie_word_embeddings=True)
    if cache >= 0:
        config.use_cache = bool(cache)
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (batch, seq))
    return Qwen2ForCausalLM(config), {"input_ids": ids, "labels": ids.clone()}


def row(way: str, autocast: str | None, cache: int, args: argparse.Namespace) -> str:
    """One line of the table (and, with ``--train``, what training the joint schedule measured)."""
    options = {"layers": args.layers, "seq": args.seq, "cache": cache}
    chain = profile("experiments.casts:qwen2", ProfileOptions(batch=args.batch, repeats=args.repeats, warmup=1,
                                                                options=options, autocast=autocast)).chain
    blocks = [s for s in chain.stages if s.name.startswith("model.layers.")]
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain)
    opts = Options(recompute=True, time_limit_s=args.time_limit)
    checkpoint = solve(chain, 2 * peak, "checkpoint-blocks", opts)
    at = checkpoint.schedule.predicted["peak_bytes"]
    joint = solve(chain, at, "ilp", opts)
    step, ours = checkpoint.simulation.makespan_s, joint.simulation.makespan_s
    line = (f"| {way} | {len(chain.recomputable)} of {chain.L - 1} "
            f"| {format_bytes(blocks[0].fwd_peak_bytes)} → {format_bytes(blocks[-1].fwd_peak_bytes)} "
            f"| {format_bytes(blocks[0].bwd_peak_bytes)} → {format_bytes(blocks[-1].bwd_peak_bytes)} "
            f"| {100 * floor / peak:.1f}% | {format_bytes(int(chain.cb.sum()))} "
            f"| {format_seconds(step)} at {format_bytes(at)} | {format_seconds(ours)} ({100 * (ours / step - 1):+.1f}%), "
            f"casts kept in {len(joint.schedule.casts_kept)} of {len(chain.castable)} |")
    if args.train:
        for name, res in (("checkpoint-blocks", checkpoint), ("joint", joint)):
            report, error = train(None, chain, res.schedule, TrainOptions(steps=2, check_grads=True, op_memory=True,
                                                                           compare=name == "joint"))
            m, p = report.measured, report.predicted
            over = sum(b > p.op_bytes[op] for op, b in m.op_peak_bytes.items())
            line += (f" {name} trained: {format_seconds(m.step_s)} (predicted {format_seconds(p.step_s)}), peak "
                     f"{format_bytes(m.activation_peak_bytes)} (predicted {format_bytes(p.activation_peak_bytes)}), "
                     f"{over} ops above their prediction, gradients {'bit for bit' if report.grads_match else 'DIFFER'}"
                     + (f", error: {error}" if error else "") + ";")
        sac = report.compare["selective_checkpoint"]
        line += (f" SAC (matmuls) measured: {format_seconds(sac.step_s)}, peak {format_bytes(sac.activation_peak_bytes)}"
                 if sac.step_s else f" SAC (matmuls) failed: {sac.error}")
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps of each profile (5)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="of each joint solve, seconds (60)")
    ap.add_argument("--train", action="store_true", help="train both schedules of each way, gradients checked")
    args = ap.parse_args(argv)
    print(f"Qwen2, {args.layers} layers, batch {args.batch}, sequence {args.seq}; {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("| configuration | blocks recomputable | layer fwd peak, first → last | bwd peak | smallest budget | casts "
          "| checkpoint-blocks | joint at its peak |")
    print("|---|---|---|---|---|---|---|---|")
    for way, autocast, cache in WAYS:
        print(row(way, autocast, cache, args), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
