"""Each unit offloaded alone, op by op: does a chain of the compiled graph predict every op?

    python -m experiments.compiled_op_memory              # about 20 minutes on 2 CPU cores
    python -m experiments.compiled_op_memory vit mixtral  # some of them

The models of ``experiments.compiled_models``, each profiled compiled as one graph by
Inductor (``offload profile --compile inductor --whole-graph``).  Schedules: no offload, the
floor (every unit released at once, fetched just in time), and each unit offloaded alone,
released after the next stage, fetched at the first prefetch point its chain allows and at
the last.  Each runs one step compiled with the profiler's marks at its stage boundaries (as
``offload train --op-memory`` does) on the lazy CPU backend; the row says how many
schedules ran, how many had an op over its prediction, the most an op was over (which
schedule, which op) and the most under (the prediction's slack).
"""
from __future__ import annotations

import time

import torch

from experiments.bench_executor import machine_name
from experiments.compiled_models import MODELS, chosen_models
from offload.executor.compiled import SchedulePartitioner
from offload.executor.marked import MarkedRun
from offload.io.text import format_bytes
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.step.actions import Offload
from offload.step.memory import floor_offloads
from offload.step.schedule import make_schedule

BATCH = 2


def schedules(chain, every_point: bool = False):
    """Name -> schedule: none, the floor, each unit alone at its first and last prefetch point
    (``every_point``: at each)."""
    out = {"none": make_schedule(chain, []), "floor": make_schedule(chain, floor_offloads(chain))}
    for i in chain.offloadable:
        need = chain.stage(i).need_from
        for p in range(need, chain.L + 1) if every_point else sorted({need, chain.L}):
            out[f"U{i} fetched at B{p}"] = make_schedule(chain, [Offload(i, min(i + 1, chain.L), p)])
    return out


def excess(model: str, options: dict, batch: int, backend: str = "inductor", every_point: bool = False):
    """The model's chain of its compiled graph, and per schedule (``schedules``) how much each
    op's memory (``offload train --op-memory``) is over the simulator's."""
    chain = profile(model, ProfileOptions(batch=batch, repeats=1, warmup=1, encodings=False, options=options,
                                          compile=backend, whole_graph=True, recompute=False)).chain
    out = {}
    for name, schedule in schedules(chain, every_point).items():
        torch.manual_seed(1)
        partitioner = SchedulePartitioner(chain, schedule, copy_backend="cpu-lazy", marks=True)
        run = MarkedRun(resolve(model, batch, options), partitioner, torch.device("cpu"), backend)
        run.step()  # compiles, makes the gradients
        measured = run.op_peaks(chain)
        out[name] = {o.name: measured[o.name] - o.mem_bytes for o in schedule.simulate(chain).ops}
    return chain, out


def row(tag: str) -> str:
    t0 = time.perf_counter()
    chain, by_schedule = excess(*MODELS[tag], BATCH)
    over = [(d, name, op) for name, ops in by_schedule.items() for op, d in ops.items()]
    worst, least = max(over), min(over)
    broken = sum(any(d > 0 for d in ops.values()) for ops in by_schedule.values())
    return (f"| {tag} | {chain.L} | {len(by_schedule)} | {broken} | {format_bytes(max(worst[0], 0))}"
            + (f" ({worst[1]}, {worst[2]})" if worst[0] > 0 else "")
            + f" | {format_bytes(-least[0])} ({least[1]}, {least[2]}) | {time.perf_counter() - t0:.0f} s |")


def main(argv: list[str] | None = None) -> int:
    models = chosen_models(argv, __doc__.splitlines()[0])
    print(f"{machine_name('cpu')}; batch {BATCH}; one step of each schedule, op by op")
    print("| model | stages | schedules | schedules with an op over | most over (schedule, op) "
          "| most under (schedule, op) | time |")
    print("|---|---|---|---|---|---|---|")
    for tag in models:
        print(row(tag), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
