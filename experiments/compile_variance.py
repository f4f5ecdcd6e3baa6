"""How much a compiled step's time varies from one compile of the same model to the next.

    python -m experiments.compile_variance            # a GPT (4 layers, width 64), about 2 minutes here

A chain of the compiled graph (``offload profile --compile inductor --whole-graph``) times
the graph the profiler compiled; training compiles it again.  Where two compiles of one
model give different code, the prediction is off by their difference, whatever the model.
This compiles one module ``--compiles`` times each way and times ``--steps`` steps of each
compile (medians): plain ``torch.compile``; ``compile_scheduled`` with an empty schedule,
Inductor's ``reorder_for_peak_memory`` on (as for a chain of the eager model, no copies);
and the same with it off (as for a chain of the compiled graph, and whenever our copies are
in the graph).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments.bench_executor import machine_name
from offload.executor.compiled import compile_scheduled
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.step.schedule import make_schedule

MODEL = {"layers": 4, "width": 64, "heads": 4, "seq": 64, "vocab": 128}


def step_ms(spec, module, steps: int) -> float:
    """The median of ``steps`` timed steps (forward, loss, backward), after three."""
    params = list(spec.module.parameters())
    times = []
    for i in range(steps + 3):
        spec.zero_grads(params)
        args, kwargs = spec.batch()
        t = time.perf_counter()
        spec.loss(module(*args, **kwargs)).backward()
        if i >= 3:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compiles", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    spec = resolve("gpt", 4, MODEL)
    chain = profile("gpt", ProfileOptions(batch=4, repeats=1, warmup=1, encodings=False, options=MODEL)).chain
    empty = make_schedule(chain, [])
    ways = {"torch.compile": lambda m: torch.compile(m),
            "compile_scheduled, reorder_for_peak_memory on": lambda m: compile_scheduled(m, chain, empty),
            "compile_scheduled, reorder_for_peak_memory off": lambda m: compile_scheduled(
                m, chain, empty, options={"reorder_for_peak_memory": False})}
    print(f"GPT {MODEL}, batch 4; {machine_name('cpu')}; the step of each of {args.compiles} compiles "
          f"(median of {args.steps} steps):")
    for name, make in ways.items():
        times = []
        for _ in range(args.compiles):
            torch._dynamo.reset()
            times.append(step_ms(spec, make(spec.module), args.steps))
        print(f"  {name}: {', '.join(f'{t:.2f}' for t in times)} ms (max/min {max(times) / min(times):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
