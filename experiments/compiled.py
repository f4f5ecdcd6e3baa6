"""The schedule inside ``torch.compile`` against the eager executor (issue #35), on the CPU.

    python -m experiments.compiled                     # a GPT (width 256, 6 layers), about 2 minutes here
    python -m experiments.compiled --model llama       # the transformers Llama (SDPA, dropout)
    python -m experiments.compiled --device cuda       # on a GPU (make gpu-bench): the copies real

One model, profiled once eager and once compiled as one graph (``--whole-graph``,
``offload.profiler.compiled``), then one training step after another of each way, the ways
interleaved so that a loaded machine slows all alike (medians over ``--steps``):

* ``eager``: the module; ``Offloaded, empty``: our executor moving nothing;
  ``Offloaded, recompute``: every stage the executor can re-run recomputed on its own;
  ``Offloaded, offload``: every other unit of the floor schedule offloaded;
* ``compile``: ``torch.compile(module)`` (Inductor), as users compile;
  (``Offloaded(torch.compile(module))``, a graph break at every stage boundary, is not
  here: its compiled stages save other bytes than the eager chain measured, 8.55 MB where
  it says 8.94 MB for the GPT's first block, and the executor stops at that stage, as it
  must; it needs a chain profiled with ``--compile``);
* ``compile_scheduled, empty``, ``, recompute`` and ``, offload``: one graph with the same
  schedules in it (``offload.executor.compiled``; the offloads our own copy ops at the
  schedule's events, run by the CPU backend and host arena ``Offloaded`` uses);
* ``compile_scheduled, offload by PyTorch``: the same offloads placed by PyTorch's own
  activation offloading pass (``copies="pytorch"``), the baseline; ``, matmuls by PyTorch``:
  that pass given every matmul's, convolution's and attention's output instead
  (``copies="pytorch-matmuls"``), as its users mark them;
* ``Offloaded, joint`` and ``compile_scheduled, joint``: the joint ILP's schedule for
  ``--budget`` (offloads, recomputations, offloaded checkpoints; no encodings, which a
  compiled graph cannot run), eager and in one graph: the budget is the eager chain's, so
  the compiled way's peak is measured against it, not predicted;
* ``compile_scheduled, its own chain, empty`` and ``, ilp``: on the chain of the compiled
  graph, no schedule, and the joint ILP's (offloads, and recomputation of the stages that
  chain offers it for) for the same budget, or that chain's smallest feasible budget where
  it is higher, compiled and metered before it is used (``offload solve --verify``): its
  step and peak predicted, the budget a promise.

Beside each: how many graphs Dynamo compiled for it (a graph break makes one more), its
step, the most bytes the allocator held during a step beyond what it held before (every
allocation, Inductor's too: ``torch.profiler``'s memory events), the step and peak the
simulator predicts for the schedules of a chain, and per stage the bytes the eager chain
saves for the backward against the bytes the compiled forward graph saves (its
partitioner's ``saved_bytes``, model outputs and inputs included).  On a CPU Inductor's code is C++ on the cores, there are no
copies to hide, and the host is the device: the times compare the ways' work only; a copy
"to the host" stays in the same memory (our host arena, eager or compiled, is allocated
before the step, so its offloads show as freed; PyTorch's ``device_put`` to the CPU is a
no-op that Inductor removes).
Writes ``experiments/results/compiled/<model>.md`` (``<model>-cuda.md`` on a GPU, whose
peaks are the caching allocator's).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from experiments.bench_executor import machine_name
from offload.core.devices import pick_device
from offload.errors import InfeasibleBudget
from offload.executor import Offloaded
from offload.executor.compiled import compile_scheduled
from offload.io.files import write_atomic
from offload.io.text import format_bytes
from offload.models import resolve
from offload.core.meters import allocated_peak
from offload.profiler.profile import ProfileOptions, profile
from offload.profiler.verify import solve_verified
from offload.step.actions import Recompute
from offload.solver.methods import Options, solve
from offload.step.memory import floor_offloads, no_offload_peak, smallest_feasible_budget
from offload.step.schedule import Schedule, make_schedule

RESULTS = Path(__file__).parent / "results" / "compiled"
MODELS = {"gpt": {"layers": 6, "width": 256, "heads": 8, "seq": 128, "vocab": 1024, "dropout": 0.1},
          "llama": {"layers": 4, "width": 256, "heads": 8, "kv_heads": 4, "seq": 128, "vocab": 1024, "dropout": 0.1}}


def describe(schedule: Schedule) -> str:
    runs = schedule.recompute
    return (f"{len(schedule.offloads)} units offloaded, {len(runs)} runs recomputed "
            f"({sum(1 for r in runs if r.moves)} checkpoints offloaded)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="gpt")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=15, help="timed steps of each way, interleaved (15)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--layers", type=int, help="blocks (default: the model's size above)")
    ap.add_argument("--width", type=int, help="hidden width (default: the model's size above)")
    ap.add_argument("--budget", type=int, default=40,
                    help="the joint ways' budget, %% of the no-offload peak (40; raised by 5%% until it fits)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (experiments/results/compiled)")
    args = ap.parse_args(argv)
    device = pick_device(args.device)
    options = {**MODELS[args.model], **{k: v for k, v in (("layers", args.layers), ("width", args.width)) if v}}
    chain = profile(args.model, ProfileOptions(batch=args.batch, repeats=2, warmup=1, encodings=False,
                                               options=options, device=device.type)).chain
    empty = make_schedule(chain, [])
    again = make_schedule(chain, [], recompute=[Recompute(i, i) for i in sorted(chain.recomputable)])
    moving = make_schedule(chain, floor_offloads(chain)[::2])
    share = args.budget
    while True:  # the joint ILP's schedule for the budget, or for the next 5% of the peak that fits
        budget = no_offload_peak(chain) * share // 100
        try:
            joint = solve(chain, budget, "ilp", Options(recompute=True, encodings="none", time_limit_s=30)).schedule
            break
        except InfeasibleBudget:
            share += 5
    print("  profiling the model compiled as one graph", flush=True)
    whole = profile(args.model, ProfileOptions(batch=args.batch, repeats=2, warmup=1, encodings=False, options=options,
                                               device=device.type, compile="inductor", whole_graph=True)).chain
    whole_budget = max(budget, smallest_feasible_budget(whole, recompute=True))
    print("  solving on it and verifying the schedule compiled (offload solve --verify)", flush=True)
    solved = solve_verified(whole, whole_budget, "ilp", Options(time_limit_s=30, recompute=True)).schedule
    spec = resolve(args.model, args.batch, options)
    spec.place(device, torch.float32)
    torch._dynamo.config.cache_size_limit = 64  # the same forward, compiled once per way

    def own(make):  # each way its own copy of the module (an Offloaded one's boundaries would break a graph)
        module = copy.deepcopy(spec.module)
        return make(module), list(module.parameters())
    nothing = make_schedule(whole, [])
    ways = {"eager": (own(lambda m: m), None, None),  # name -> (module and its weights, schedule, its chain)
            "Offloaded, empty": (own(lambda m: Offloaded(m, chain, empty)), empty, chain),
            "Offloaded, recompute": (own(lambda m: Offloaded(m, chain, again)), again, chain),
            "Offloaded, offload": (own(lambda m: Offloaded(m, chain, moving)), moving, chain),
            "Offloaded, joint": (own(lambda m: Offloaded(m, chain, joint)), joint, chain),
            "compile": (own(torch.compile), None, None),
            "compile_scheduled, empty": (own(lambda m: compile_scheduled(m, chain, empty)), None, None),
            "compile_scheduled, recompute": (own(lambda m: compile_scheduled(m, chain, again)), None, None),
            "compile_scheduled, offload": (own(lambda m: compile_scheduled(m, chain, moving)), None, None),
            "compile_scheduled, offload by PyTorch": (own(lambda m: compile_scheduled(m, chain, moving,
                                                                                      copies="pytorch")), None, None),
            "compile_scheduled, matmuls by PyTorch": (own(lambda m: compile_scheduled(m, chain, empty,
                                                                                      copies="pytorch-matmuls")),
                                                      None, None),
            "compile_scheduled, joint": (own(lambda m: compile_scheduled(m, chain, joint)), None, None),
            "compile_scheduled, its own chain, empty": (own(lambda m: compile_scheduled(m, whole, nothing)),
                                                        nothing, whole),
            "compile_scheduled, its own chain, ilp": (own(lambda m: compile_scheduled(m, whole, solved)),
                                                      solved, whole)}

    def step(way) -> None:
        run, params = way[0]
        spec.loss(run(*spec.args, **spec.kwargs)).backward()
        spec.zero_grads(params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's time is the device's too

    graphs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, way in ways.items():  # warm-up: the compiles, counted
            print(f"  warming up {name}", flush=True)
            before = counters["stats"]["unique_graphs"]
            step(way)
            step(way)
            graphs[name] = counters["stats"]["unique_graphs"] - before
        peaks = {name: allocated_peak(lambda: step(way), device) for name, way in ways.items()}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.steps):
        for name, way in ways.items():
            t = time.perf_counter()
            step(way)
            times[name].append(time.perf_counter() - t)
    eager = statistics.median(times["eager"])
    lines = [f"`python -m experiments.compiled --model {args.model}`: {chain.name}, {chain.L} stages, "
             f"{len(chain.recomputable)} recomputed in the recompute ways; the joint ways' schedule solved for "
             f"{format_bytes(budget)} ({share}% of the peak): {describe(joint)}; the chain of the model compiled as "
             f"one graph (`--whole-graph`): peak {format_bytes(no_offload_peak(whole))}, floor "
             f"{format_bytes(smallest_feasible_budget(whole))}, its ilp schedule solved for "
             f"{format_bytes(whole_budget)} and verified compiled ({solved.solver['verified']['rounds']} solve(s), "
             f"metered peak {format_bytes(solved.solver['verified']['measured_peak_bytes'])}): {describe(solved)}; "
             f"{machine_name(device.type)}, "
             f"medians of {args.steps} interleaved steps.", "",
             "| way | graphs | step | x eager | predicted step | peak allocated | predicted peak |",
             "|---|---|---|---|---|---|---|"]
    for name, (_, sched, of) in ways.items():
        med = statistics.median(times[name])
        sim = sched.simulate(of) if sched is not None else None
        lines.append(f"| {name} | {graphs[name]} | {med * 1e3:.1f} ms | {med / eager:.2f} | "
                     f"{f'{sim.makespan_s * 1e3:.1f} ms' if sim else '-'} | {format_bytes(peaks[name])} | "
                     f"{format_bytes(sim.peak_bytes) if sim else '-'} |")
    ours, theirs = (ways[n][0][0].partitioner for n in ("compile_scheduled, offload",
                                                          "compile_scheduled, offload by PyTorch"))
    per_step = ours.runtime.d2h_bytes // (args.steps + 3)  # warm-up, peak and timed steps
    lines += ["", f"Moved per step by the offload ways: `Offloaded` {format_bytes(moving.simulate(chain).d2h_bytes)} "
              f"(predicted), `compile_scheduled` {format_bytes(per_step)} each way (its units: "
              f"{format_bytes(sum(m for m, _ in ours.moved.values()))}, "
              f"{format_bytes(sum(left for _, left in ours.moved.values()))} left on the device), PyTorch's pass "
              f"{format_bytes(sum(m for m, _ in theirs.moved.values()))} "
              f"({format_bytes(sum(left for _, left in theirs.moved.values()))} of the units left on the device: "
              "views, getitems, non-contiguous tensors); PyTorch's pass given every matmul's output "
              f"{format_bytes(ways['compile_scheduled, matmuls by PyTorch'][0][0].partitioner.host_bytes())}."]
    kept, recomputing = (ways[n][0][0].partitioner.saved_bytes() for n in
                         ("compile_scheduled, empty", "compile_scheduled, recompute"))
    lines += ["", "Saved for the backward, per stage: the eager chain's unit, and the compiled forward graph's "
              "storages by unit (the first stage whose backward reads them; 0: its inputs, weights and batch).", "",
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
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.model}{'-cuda' if device.type == 'cuda' else ''}.md"
    write_atomic(out, lambda fh: fh.write(table))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
