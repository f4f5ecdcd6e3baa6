"""A chain of the compiled graph recomputing stages: each op of seven schedules against the model.

    python -m experiments.compiled_recompute                 # aot_eager and inductor, about 2 minutes here
    python -m experiments.compiled_recompute --backend inductor --layers 4

A chain of the compiled graph (``offload profile --compile B --whole-graph``) offers each
stage the eager profile can re-run as a run of one stage, its costs read from two more
compiles with marks, each recomputing every other such stage (``offload.profiler.compiled``,
"recomputation"). This experiment profiles a GPT (4 layers, dropout 0.1) so, then compiles
seven schedules with marks (of the stages it recomputes every other one, the others, all,
the inner ones, every other one with the others offloaded, and the joint ILP's at two
budgets) and sets each
op's measured memory against the simulator's. The table says, per schedule, the most an op
held over its prediction: above 0, the chain breaks its budget there.
"""
from __future__ import annotations

import argparse

import torch

from experiments.bench_executor import machine_name
from offload.executor.compiled import SchedulePartitioner
from offload.executor.marked import MarkedRun
from offload.io.text import format_bytes
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step.actions import Offload, Recompute
from offload.step.chain import Chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget
from offload.step.schedule import Schedule, make_schedule

BATCH = 4


def gpt(layers: int) -> dict:
    return {"layers": layers, "width": 64, "heads": 4, "seq": 64, "vocab": 128, "dropout": 0.1}


def marked(chain: Chain, schedule: Schedule, options: dict, backend: str) -> MarkedRun:
    torch.manual_seed(1)
    run = MarkedRun(resolve("gpt", BATCH, options), SchedulePartitioner(chain, schedule, copy_backend="cpu-lazy",
                                                                        marks=True), torch.device("cpu"), backend)
    run.step()  # compiles, makes the gradients
    return run


def schedules(chain: Chain) -> dict[str, Schedule]:
    """Name -> schedule: of the stages the chain recomputes, every other one, the others, all,
    the inner ones, every other one with the others offloaded, and the joint ILP's."""
    rec = sorted(chain.recomputable)
    ones = lambda ks: [Recompute(k, k) for k in ks]  # noqa: E731
    out = {"every other stage": make_schedule(chain, [], recompute=ones(rec[0::2])),
           "the others": make_schedule(chain, [], recompute=ones(rec[1::2])),
           "all stages": make_schedule(chain, [], recompute=ones(rec)),
           "inner stages": make_schedule(chain, [], recompute=ones(rec[1:-1])),
           "every other one, the others offloaded": make_schedule(chain, [Offload(k, k + 1, k) for k in rec[1::2]],
                                                                  recompute=ones(rec[0::2]))}
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain, recompute=True)
    for share in (0.3, 0.6):
        schedule = solve(chain, int(floor + share * (peak - floor)), "ilp",
                         Options(time_limit_s=20, recompute=True)).schedule
        out[f"joint ILP, {share:.0%} between floor and peak"] = schedule
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["aot_eager", "inductor"], action="append")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    print(f"{machine_name(torch.device('cpu'))}; GPT, {args.layers} layers, batch {BATCH}\n")
    print("| backend | schedule | recomputed | offloaded | predicted peak | measured peak | most an op held over its prediction |")
    print("|---|---|---|---|---|---|---|")
    for backend in args.backend or ["aot_eager", "inductor"]:
        options = gpt(args.layers)
        chain = profile("gpt", ProfileOptions(batch=BATCH, repeats=1, warmup=1, encodings=False, options=options,
                                              compile=backend, whole_graph=True)).chain
        for note in chain.source.get("notes", [])[1:]:  # (the first says what the chain is)
            print(f"| {backend} | {note} | | | | | |")
        for name, schedule in schedules(chain).items():
            measured = marked(chain, schedule, options, backend).op_peaks(chain)
            predicted = {o.name: o.mem_bytes for o in schedule.simulate(chain).ops}
            op = max(predicted, key=lambda o: measured[o] - predicted[o])
            print(f"| {backend} | {name} | {[r.first for r in schedule.recompute]} | "
                  f"{[o.stage for o in schedule.offloads]} | {format_bytes(max(predicted.values()))} | "
                  f"{format_bytes(max(measured.values()))} | {format_bytes(measured[op] - predicted[op])} ({op}) |",
                  flush=True)


if __name__ == "__main__":
    main()
