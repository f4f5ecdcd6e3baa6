"""Could a chain of the compiled graph offer recomputation?  Per-stage costs read from compiles, checked op by op.

    python -m experiments.compiled_recompute                 # aot_eager and inductor, about 6 minutes here
    python -m experiments.compiled_recompute --backend inductor --layers 4

A chain of the compiled graph (``offload profile --compile B --whole-graph``) offers no
recomputation: its stages are marked not re-runnable.  This experiment asks what it would
take.  It profiles a GPT (4 layers, dropout 0.1) compiled whole, then reads each stage's
recomputation costs the way the model states them (docs/model.md, "Recomputation") from two
compiles with marks (``MarkedRun``), one recomputing every odd stage and one every even
stage, each its own run, so that a run's neighbours are kept as in most schedules:

* its checkpoint: the saved storages that only the run reads in the backward
  (``input_bytes``), of which those its own forward made (its dropouts' outputs and masks,
  which a compiled run saves where the eager one draws them again: ``rerun_held_bytes``)
  and the rest, its input (``input_own_bytes``); plus what the next forward holds over its
  prediction in that compile, which stays until the run is rebuilt (under Inductor, 64 KiB
  a block: found held through ``F(k+2)`` and ``B(k+1)`` too, so booked with the checkpoint,
  not as what the stage carries into the next forward alone; not a storage a move of the
  checkpoint takes);
* its forward's transient when autograd keeps none of its unit
  (``recomputed_fwd_peak_bytes``): fitted so that the simulator gives that compile's
  measured memory of the stage's forward op exactly.

Runs are single stages (``rerun_output=False``), nothing else is carried into the next
forward (``carry_bytes=0``), and a re-run's transient is its forward's.  Then seven schedules
(those two, all stages, the inner ones, recomputation with offloads, and the joint ILP's at
two budgets) are compiled with marks and each op's measured memory is set against the
simulator's.  The table says, per schedule, the most an op held over its prediction: where
it is above 0 the chain would break its budget, and recomputation stays off.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from experiments.bench_executor import machine_name
from offload.core.devices import allocated_bytes
from offload.executor.compiled import SchedulePartitioner
from offload.executor.compiled_copies import _checkpoints
from offload.executor.marked import MarkedRun
from offload.io.text import format_bytes
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step.actions import Offload, Recompute
from offload.step.chain import Chain
from offload.step.chainfile import make_chain
from offload.step.memory import memory_profile, no_offload_peak, smallest_feasible_budget
from offload.step.schedule import Schedule, make_schedule

BATCH = 4


def gpt(layers: int) -> dict:
    return {"layers": layers, "width": 64, "heads": 4, "seq": 64, "vocab": 128, "dropout": 0.1}


def with_fields(chain: Chain, fields: dict[int, dict]) -> Chain:
    stages = [replace(s, **fields.get(k, {})) for k, s in enumerate(chain.stages, 1)]
    return make_chain(chain.name, stages, chain.platform, chain.base_bytes, chain.source, chain.recipe,
                      chain.workspace_bytes)


def marked(chain: Chain, schedule: Schedule, options: dict, backend: str) -> MarkedRun:
    torch.manual_seed(1)
    run = MarkedRun(resolve("gpt", BATCH, options), SchedulePartitioner(chain, schedule, copy_backend="cpu-lazy",
                                                                        marks=True), torch.device("cpu"), backend)
    run.step()  # compiles, makes the gradients
    return run


def checkpoints(run: MarkedRun, runs: list[Recompute]) -> tuple[dict[int, int], dict[int, int]]:
    """Per run (by its stage), the bytes of the saved storages only it reads in the backward,
    as the compiled copies find an offloaded checkpoint's (``compiled_copies._checkpoints``),
    each whole as the allocator counts it, and of those the ones its own forward made."""
    p = run.partitioner
    forward, backward = p.graphs
    inputs = {n.name for n in backward.graph.find_nodes(op="placeholder")}
    outputs = forward.graph.find_nodes(op="output")[0].args[0]
    model_outputs = next(i for i, n in enumerate(outputs) if isinstance(n, torch.fx.Node) and n.name in inputs)
    whole, own = {r.first: 0 for r in runs}, {r.first: 0 for r in runs}
    for s in _checkpoints(forward, backward, model_outputs, runs, p.stages, p.back_stages, set()):
        value = s.values[0].meta["val"]
        nbytes = allocated_bytes(value.untyped_storage().nbytes(), value.device)
        whole[s.run.first] += nbytes
        own[s.run.first] += nbytes if p.stages.get(s.values[0].name) == s.run.first else 0
    return whole, own


def recomputing_chain(chain: Chain, options: dict, backend: str) -> Chain:
    """``chain`` with every stage but the last re-runnable, its costs read as the module says."""
    L = chain.L
    base = with_fields(chain, {k: dict(recomputable=True, rerun_output=False, carry_bytes=0, bwd_start_bytes=0)
                               for k in range(1, L)})
    fields = {}
    for part in (list(range(1, L, 2)), list(range(2, L, 2))):
        runs = [Recompute(k, k) for k in part]
        run = marked(base, make_schedule(base, [], recompute=runs), options, backend)
        whole, own = checkpoints(run, runs)
        measured = run.peaks()
        costs = {k: dict(input_bytes=whole[k], input_own_bytes=whole[k] - own[k], rerun_held_bytes=own[k]) for k in part}
        fitted = with_fields(base, costs)
        predicted, _ = memory_profile(fitted, [], runs)
        for k in part:
            unbooked = max(0, measured[k] - int(predicted[k]))  # held from F(k+1) on: part of its checkpoint
            fields[k] = {**costs[k], "input_bytes": costs[k]["input_bytes"] + unbooked,  # (not one a move takes)
                         "recomputed_fwd_peak_bytes": int(fitted.rfp[k]) + measured[k - 1] - int(predicted[k - 1])}
    return with_fields(base, fields)


def schedules(chain: Chain) -> dict[str, Schedule]:
    L = chain.L
    ones = lambda ks: [Recompute(k, k) for k in ks]  # noqa: E731
    out = {"odd stages": make_schedule(chain, [], recompute=ones(range(1, L, 2))),
           "even stages": make_schedule(chain, [], recompute=ones(range(2, L, 2))),
           "all stages": make_schedule(chain, [], recompute=ones(range(1, L))),
           "inner stages": make_schedule(chain, [], recompute=ones(range(2, L - 1))),
           "odd, even offloaded": make_schedule(chain, [Offload(k, k + 1, k) for k in range(2, L, 2)],
                                                recompute=ones(range(1, L, 2)))}
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
        chain = recomputing_chain(chain, options, backend)
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
