"""The schedule inside ``torch.compile`` against the eager executor (issue #35), on the CPU.

    python -m experiments.compiled                     # a GPT (width 256, 6 layers), about a minute here
    python -m experiments.compiled --model llama       # the transformers Llama (SDPA, dropout)

One model, profiled once (eager), then one training step after another of each way, the
ways interleaved so that a loaded machine slows all alike (medians over ``--steps``):

* ``eager``: the module; ``Offloaded, empty``: our executor moving nothing;
  ``Offloaded, recompute``: every stage the executor can re-run recomputed on its own;
* ``compile``: ``torch.compile(module)`` (Inductor), as users compile;
* ``compile_scheduled, empty`` and ``compile_scheduled, recompute``: one graph with the
  same schedules in it (``offload.executor.compiled``).

Beside each: the step the simulator predicts for the eager schedules, and per stage the bytes
the eager chain saves for the backward against the bytes the compiled forward graph saves
(its partitioner's ``saved_bytes``): what a chain of the compiled graph would have to
measure (issue #35, item 2).  On a CPU Inductor's code is C++ on the cores, there are no
copies to hide, and the host is the device: the times compare the ways' work only.
Writes ``experiments/results/compiled/<model>.md``.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from pathlib import Path

import torch

from offload.executor import Offloaded
from offload.executor.compiled import compile_scheduled
from offload.io.files import write_atomic
from offload.io.text import format_bytes
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.step.actions import Recompute
from offload.step.schedule import make_schedule

RESULTS = Path(__file__).parent / "results" / "compiled"
MODELS = {"gpt": {"layers": 6, "width": 256, "heads": 8, "seq": 128, "vocab": 1024, "dropout": 0.1},
          "llama": {"layers": 4, "width": 256, "heads": 8, "kv_heads": 4, "seq": 128, "vocab": 1024, "dropout": 0.1}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="gpt")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=15, help="timed steps of each way, interleaved (15)")
    args = ap.parse_args(argv)
    options = MODELS[args.model]
    chain = profile(args.model, ProfileOptions(batch=args.batch, repeats=2, warmup=1, encodings=False,
                                               options=options)).chain
    empty = make_schedule(chain, [])
    again = make_schedule(chain, [], recompute=[Recompute(i, i) for i in sorted(chain.recomputable)])
    spec = resolve(args.model, args.batch, options)
    torch._dynamo.config.cache_size_limit = 64  # the same forward, compiled once per way

    def own(make):  # each way its own copy of the module (an Offloaded one's boundaries would break a graph)
        module = copy.deepcopy(spec.module)
        return make(module), list(module.parameters())
    ways = {"eager": (own(lambda m: m), None),
            "Offloaded, empty": (own(lambda m: Offloaded(m, chain, empty)), empty),
            "Offloaded, recompute": (own(lambda m: Offloaded(m, chain, again)), again),
            "compile": (own(torch.compile), None),
            "compile_scheduled, empty": (own(lambda m: compile_scheduled(m, chain, empty)), None),
            "compile_scheduled, recompute": (own(lambda m: compile_scheduled(m, chain, again)), None)}

    def step(way) -> None:
        run, params = way
        spec.loss(run(*spec.args, **spec.kwargs)).backward()
        spec.zero_grads(params)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (way, _) in ways.items():  # warm-up: the compiles
            print(f"  warming up {name}", flush=True)
            step(way)
            step(way)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.steps):
        for name, (way, _) in ways.items():
            t = time.perf_counter()
            step(way)
            times[name].append(time.perf_counter() - t)
    eager = statistics.median(times["eager"])
    lines = [f"`python -m experiments.compiled --model {args.model}`: {chain.name}, {chain.L} stages, "
             f"{len(chain.recomputable)} recomputed in the recompute ways; torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, medians of {args.steps} interleaved steps.", "",
             "| way | step | x eager | predicted (eager chain) |", "|---|---|---|---|"]
    for name, (_, sched) in ways.items():
        med = statistics.median(times[name])
        predicted = f"{sched.simulate(chain).makespan_s * 1e3:.1f} ms" if sched is not None else "-"
        lines.append(f"| {name} | {med * 1e3:.1f} ms | {med / eager:.2f} | {predicted} |")
    kept, recomputing = (ways[n][0][0].partitioner.saved_bytes() for n in
                         ("compile_scheduled, empty", "compile_scheduled, recompute"))
    lines += ["", "Saved for the backward, per stage: the eager chain's unit, and the compiled forward graph's "
              "values by the stage that made them (stage 0: its inputs, weights and batch).", "",
              "| stage | eager chain | compiled | compiled, recompute |", "|---|---|---|---|"]
    for k in range(0, chain.L + 1):
        eager_bytes = format_bytes(chain.stage(k).saved_bytes) if k else "-"
        lines.append(f"| {k}{' ' + chain.stage(k).name if k else ''} | {eager_bytes} | "
                     f"{format_bytes(kept.get(k, 0))} | {format_bytes(recomputing.get(k, 0))} |")
    total = sum(s.saved_bytes for s in chain.stages)
    lines.append(f"| all | {format_bytes(total)} | {format_bytes(sum(kept.values()))} | "
                 f"{format_bytes(sum(recomputing.values()))} |")
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_atomic(RESULTS / f"{args.model}.md", lambda fh: fh.write(table))
    print(f"wrote {RESULTS / (args.model + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
