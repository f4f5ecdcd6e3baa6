"""The profiler's subcommand of ``offload``: ``profile``.  Importing this module is cheap (the
parser only); torch is imported when the command runs."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from offload.errors import FormatError
from offload.io.argtypes import integer
from offload.io.files import model_input, output_path
from offload.io.text import parse_rate, parse_seconds
from offload.step.names import AUTOCAST, COMPILE_BACKENDS, DTYPES, OPTIMIZERS


def _platform(args: argparse.Namespace):
    from .bandwidth import given_platform
    if args.bandwidth is None:
        if args.latency is not None:
            raise FormatError("--latency needs --bandwidth", "give both to plan for another machine, or neither to measure")
        return None
    rates = [parse_rate(r) for r in args.bandwidth.split(",")]
    if len(rates) > 2:
        raise FormatError(f"--bandwidth takes one rate or D2H,H2D, got {args.bandwidth!r}")
    return given_platform(rates[0], rates[-1], parse_seconds(args.latency) if args.latency else 0.0)


def solve_verified(*args: Any) -> Any:
    """``offload solve --verify`` (``verify.solve_verified``): the profiler compiles and meters
    the schedule, so the solver's command takes it from here (torch imported only then)."""
    from .verify import solve_verified as verified
    return verified(*args)


def cmd_profile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from offload.models import parse_options, zoo_help
    from offload.step.chainfile import save_chain
    from offload.solver.cli import print_chain
    from offload.io.text import printable

    from .linearize import write_op_graphml
    from .profile import ProfileOptions, profile
    if args.list_models:
        print(zoo_help())
        print("torchvision:NAME  any torchvision model (when torchvision is installed). Options: image=224, classes=1000.")
        print("FILE.py:FN / package.module:FN  FN(batch_size, **options) -> (module, example_input[, loss_fn]); "
              "the input is a tensor, a tuple of tensors or a dict of keyword tensors (plain values such as "
              "return_loss=True beside them)")
        return 0
    if args.model is None or args.batch is None or args.output is None:
        raise FormatError("MODEL, --batch and -o are required", "e.g. offload profile resnet50 --batch 32 -o chain.json")
    opts = ProfileOptions(batch=args.batch, device=args.device, dtype=args.dtype, optimizer=args.optimizer,
                          repeats=args.repeats, warmup=args.warmup, stages=args.stages,
                          options=parse_options(args.option), seed=args.seed, platform=_platform(args), name=args.name,
                          encodings=not args.no_encodings, autocast=args.autocast,
                          set_to_none=args.set_to_none, keep_cache=args.keep_cache, compile=args.compile,
                          whole_graph=args.whole_graph, split_blocks=args.split_blocks,
                          recompute=not args.no_recompute)
    per_measure = 2 + opts.repeats  # warm-up, memory pass, the timed steps (twice with --stages)
    with tqdm(total=4 + per_measure * (2 if opts.stages else 1) + 2 * opts.encodings, desc=f"profiling {args.model}",
              unit="step", file=sys.stderr, disable=args.quiet, leave=False) as bar:
        def tick(phase: str) -> None:
            bar.set_postfix_str(f"{phase} done")
            bar.update(1)
        result = profile(args.model, opts, tick)
    save_chain(result.chain, args.output)
    if args.graphml:
        write_op_graphml(result.capture, result.stages, args.graphml)
    if not args.quiet:
        print_chain(result.chain)  # with the profiler's notes
    for warning in result.warnings:
        print(f"warning: {printable(warning)}", file=sys.stderr)
    print(f"wrote {args.output}" + (f" and {args.graphml}" if args.graphml else ""))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="measure a model: per-stage times, saved bytes, transients, copy bandwidth → chain.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a real PyTorch model and write its chain. One forward and loss find where the model can be "
                    "cut into stages: module calls whose output every later computation reads. Then, with stage "
                    "boundaries at those calls of your own module, each stage's forward/backward time (median of "
                    "--repeats), bytes saved for backward (deduplicated by storage), transient peaks, and the "
                    "platform's copy bandwidth are measured on --device.",
        epilog="MODEL is a zoo name (--list-models), torchvision:NAME, path/file.py:fn or package.module:fn where\n"
               "fn(batch_size, **options) returns (module, example_input[, loss_fn]); example_input is a tensor,\n"
               "a tuple of tensors or a dict of keyword tensors (plain values such as return_loss=True beside\n"
               "them); without loss_fn the loss is output.loss when the\n"
               "model computes one (Hugging Face labels=), else the mean of the squared outputs.\n\n"
               "examples:\n"
               "  offload profile resnet50 --batch 32 -o resnet50.json\n"
               "  offload profile gpt2 --batch 8 -O layers=12 -O width=768 -O seq=1024 -o gpt2.json\n"
               "  offload profile my_model.py:build --batch 16 --stages 24 -o mine.json --graphml mine.graphml\n"
               "  offload profile resnet101 --batch 64 --bandwidth 25GB/s -o plan.json   # plan for another link")
    p.add_argument("model", nargs="?", metavar="MODEL", type=model_input, help="what to profile (see below)")
    p.add_argument("--batch", type=integer(1), help="batch size")
    p.add_argument("-o", "--output", metavar="CHAIN", type=output_path, help="where to write chain.json")
    p.add_argument("-O", "--option", action="append", metavar="KEY=VALUE",
                   help="model option, repeatable (image=224, layers=12, seq=1024, …; see --list-models)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter and activation dtype (default float32)")
    p.add_argument("--autocast", choices=AUTOCAST, default=None,
                   help="run forward and loss under torch.autocast to this dtype, as the training will (the "
                        "executor refuses a run under another autocast)")
    p.add_argument("--compile", choices=COMPILE_BACKENDS, default=None, metavar="BACKEND",
                   help="measure the model compiled with torch.compile(backend=BACKEND: inductor, aot_eager, eager), "
                        "as the training will run it: a compiled stage saves other tensors than the eager code (a "
                        "graph break at each stage boundary; the cuts come from the eager model). offload train "
                        "compiles it alike; Offloaded refuses an uncompiled module for such a chain")
    p.add_argument("--whole-graph", action="store_true",
                   help="with --compile inductor (or aot_eager): measure the model compiled as ONE graph, as "
                        "compile_scheduled runs it: the units are what that graph saves (fewer, fused), the times "
                        "and memory that graph's, so a "
                        "schedule solved on this chain keeps its budget compiled; no encodings; each block "
                        "recomputed as a run of its own where eight more compiles show the model follows the "
                        "graph's re-runs (else a note says why not); offload train runs it with "
                        "compile_scheduled, as your loop can (docs/executor.md)")
    p.add_argument("--no-recompute", action="store_true",
                   help="measure no recomputation cost: the chain offers offloading (and encodings) only; with "
                        "--whole-graph it saves five compiles of the model")
    p.add_argument("--split-blocks", action="store_true",
                   help="cut inside each block too, at the calls of its submodules that hold submodules and "
                        "parameters (a transformer layer's attention | its MLP), whatever crosses them (the "
                        "residual): smaller stages, a lower smallest budget (a Mixtral's MoE layer alone), more to "
                        "solve; the residual add that ends a half in the block's own code is re-run with it")
    p.add_argument("--set-to-none", action="store_true",
                   help="free the gradients between steps (optimizer.zero_grad(set_to_none=True), PyTorch's default) "
                        "as the training will: they are then allocated during the backward and counted there, not "
                        "in base_bytes (default: zeroed in place, allocated all along)")
    p.add_argument("--keep-cache", action="store_true",
                   help="keep a transformers model's key/value cache on when its config asks for one (use_cache=True, "
                        "their default); by default it is turned off for training, as transformers does under "
                        "gradient checkpointing: a training step has no use for it, and it keeps every block from "
                        "being recomputed")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="its state counts in base_bytes (default adam: two moments per weight)")
    p.add_argument("--repeats", type=integer(1, 1000), default=5,
                   help="timed steps; each stage's time is their median (default 5)")
    p.add_argument("--warmup", type=integer(0, 1000), default=2, help="untimed steps first (default 2)")
    p.add_argument("--stages", type=integer(1), metavar="N",
                   help="merge the finest chain into N stages of balanced measured time (profiles twice)")
    p.add_argument("--bandwidth", metavar="RATE[,RATE]",
                   help="use these copy rates (D2H[,H2D], e.g. 25GB/s) instead of measuring: plan another machine")
    p.add_argument("--latency", metavar="SECONDS", help="per-copy latency with --bandwidth (e.g. 10us; default 0)")
    p.add_argument("--no-encodings", action="store_true",
                   help="do not look for encodable storages (ReLU sign masks, sparse storage, bf16); they are found, "
                        "sized and timed by default, one extra step")
    p.add_argument("--seed", type=integer(0), default=0, help="seed of the random weights and inputs (default 0)")
    p.add_argument("--name", help="chain name (default MODEL-bBATCH; for file.py:fn, file.fn-bBATCH)")
    p.add_argument("--graphml", metavar="FILE", type=output_path, help="also write the activation graph with each op's stage (GraphML)")
    p.add_argument("--list-models", action="store_true", help="list the zoo models and their options")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no table")
    p.set_defaults(func=cmd_profile)
