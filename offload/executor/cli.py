"""The executor's subcommand of ``offload``: ``train``.  Importing this module is cheap (the
parser only); torch is imported when the command runs."""
from __future__ import annotations

import argparse
import sys

from offload.errors import FormatError, OffloadError
from offload.io.argtypes import integer, number
from offload.io.contention import busy_warning
from offload.io.files import input_path, model_input, output_path, write_json
from offload.io.text import format_bytes, format_seconds, printable, report_error
from offload.step.chainfile import load_chain
from offload.step.names import BACKENDS, OPTIMIZERS
from offload.step.schedulefile import load_schedule

from .report import BASELINES, Predicted, Report



def _print_device_time(d: dict | None, p: Predicted) -> None:
    """The traced step's compute stream (``offload.executor.traces.device_time``) beside the
    simulator's: which part of the model a measured step missed."""
    if not d:
        return
    running = p.step_s - p.host_wait_s - p.stall_s
    print(f"{'device time':<14}measured: {format_seconds(d['busy_s'])} running, {format_seconds(d['host_wait_s'])} "
          f"waiting for the host, {format_seconds(d['copy_wait_s'])} for copies, {format_seconds(d['other_s'])} other; "
          f"predicted: {format_seconds(running)}, {format_seconds(p.host_wait_s)}, {format_seconds(p.stall_s)}")
    if d["blocking"]:
        print(f"{'host blocked':<14}" + ", ".join(f"{name} x{n} ({format_seconds(s)})"
                                                 for name, (n, s) in sorted(d["blocking"].items()))
              + " in the traced step: calls that may wait for the device")


# A pace this far from 1 says that the machine ran at another speed than when it was profiled
PACE_WARNING = 0.10


def _print_pace(r: Report) -> None:
    """This run's pace (``Report.set_compare``): the no-offload step measured against the same
    step as the chain has it (timed by the profile, else predicted), and ours predicted at that
    pace beside ours measured in the same rounds."""
    if r.pace is None:
        return
    ours = r.compared_step_s
    where = "the profile timed it at" if r.predicted.no_offload_profiled else "the chain predicts"
    print(f"{'pace':<14}{r.pace:>15.2f}x   no offloading took {format_seconds(r.compare['no_offload'].step_s)} where "
          f"{where} {format_seconds(r.predicted.no_offload_step_s)}; at this pace ours is predicted "
          f"{format_seconds(r.pace_predicted_s)}" + (f", measured {format_seconds(ours)} "
                                                     f"({100 * (ours / r.pace_predicted_s - 1):+.1f}%)" if ours else ""))
    if r.device == "cpu" and r.predicted.d2h_bytes_per_step:
        print(f"{'':<14}on a CPU the copies are memcpy on the cores that compute: the chain's link runs them beside "
              "the compute, this machine cannot (only a GPU judges their timing)")
    spread = r.predicted.no_offload_spread
    if spread is not None and spread > PACE_WARNING:
        print(f"{'':<14}the profile's plain steps spread {100 * spread:.0f}% of their median: the pace, and the error at "
              "it, are that uncertain; `python -m experiments.interleaved CHAIN SCHEDULES...` measures each "
              "schedule's ratio to no offloading, which does not depend on it")
    if abs(r.pace - 1) > PACE_WARNING:
        print(f"{'':<14}this run found the machine {'slower' if r.pace > 1 else 'faster'} than the profile did: every "
              "predicted time above is off by that much (a loaded machine, another clock); profile again when "
              "it runs as it will train")


def _print_report(r: Report) -> None:
    m, p = r.measured, r.predicted
    print(printable(f"trained {r.model} for {r.steps_done} of {r.steps} steps with {r.method or 'the'} "
                    f"schedule on {r.device} ({r.backend})"
                    + (f", rank 0 of {r.ranks} (each rank checks its own gradients)" if r.ranks > 1 else "")))
    if m.activation_peak_bytes is None:
        return
    print(f"{'':<14}{'measured':>16}{'predicted':>16}")
    if m.step_s is not None:
        print(f"{'step time':<14}{format_seconds(m.step_s):>16}{format_seconds(p.step_s):>16}"
              f"   (min {format_seconds(min(m.step_times_s))}, max {format_seconds(max(m.step_times_s))}"
              + (f"; step 1, a warm-up, {format_seconds(m.warmup_s)} left out)" if m.warmup_s is not None else ")"))
        for warning in busy_warning(m.cpu_wait_share, "this run"):
            print(f"{'':<14}{warning}")
        if r.compare is None and p.step_s and abs(m.step_s / p.step_s - 1) > PACE_WARNING:
            print(f"{'':<14}{100 * (m.step_s / p.step_s - 1):+.0f}% from the prediction: --compare times the no-offload "
                  "step beside ours and says how much of that is the machine's pace")
    print(f"{'peak memory':<14}{format_bytes(r.in_scope(m)):>16}{format_bytes(r.in_scope(p)):>16}"
          + (f"   budget {format_bytes(r.budget.nbytes)} ({r.budget.scope})" if r.budget else ""))
    if r.over_prediction:
        print(f"{'':<14}{r.over_prediction}")
    if m.reserved_peak_bytes is not None:
        print(f"{'reserved':<14}{format_bytes(m.reserved_peak_bytes):>16}   by the allocator (its slack included)")
    print(f"{'D2H per step':<14}{format_bytes(m.d2h_bytes_per_step):>16}{format_bytes(p.d2h_bytes_per_step):>16}")
    print(f"{'H2D per step':<14}{format_bytes(m.h2d_bytes_per_step):>16}{format_bytes(p.h2d_bytes_per_step):>16}")
    copies_off = r.copies_off()
    if copies_off:
        print(f"{'':<14}{copies_off}")
    print(f"{'host arena':<14}{format_bytes(m.host_arena_bytes):>16}")
    grew = r.arena_grew()
    if grew and grew not in (r.over_prediction or ""):
        print(f"{'':<14}{grew}")
    if r.encoded_units:
        print(f"{'encoded':<14}{format_bytes(m.encoded_bytes_per_step):>16}   per step, units "
              + ", ".join(f"U{i} {name}" for i, name in r.encoded_units.items())
              + (" (lossy)" if r.lossy else " (lossless)"))
    if r.compare_our_step_times_s:
        print(f"{'compare':<14}{len(r.compare_our_step_times_s):>16}   rounds of one step of ours and of each "
              "way below, in turn: each ratio is the median of the rounds'")
    for name, label in BASELINES.items():
        other = (r.compare or {}).get(name)
        if other and other.step_s:
            print(f"{label:<14}{format_seconds(other.step_s):>16}   peak {format_bytes(r.in_scope(other))}; our "
                  f"step takes {other.our_step_ratio:.2f}x its time")
        elif other:
            print(f"{label:<14}{'failed':>16}   {other.error}")
    _print_pace(r)
    if m.op_peak_bytes:
        over = {op: b - p.op_bytes[op] for op, b in m.op_peak_bytes.items() if b > p.op_bytes[op]}
        worst = max(over, key=over.get) if over else None
        blobs = r.within_blob_slack(over[worst]) if over else ""
        print("op memory     " + (f"all {len(m.op_peak_bytes)} ops within their prediction (one step)" if not over else
                                   f"{len(over)} op(s) above their prediction in one step, most {format_bytes(over[worst])} at {worst}"
                                   + (f": {blobs}" if blobs else "")))
    if r.trace:
        overlap = r.trace["copy_overlap"]
        print(f"trace         {r.trace['path']}" + (
            f"   copies {format_seconds(overlap['copy_s'])}, {overlap['fraction']:.0%} of it under compute"
            if overlap else "   (no GPU copies in it)"))
        _print_device_time(r.trace.get("device_time"), p)
    if r.grads_match is not None:
        print(f"grads_match   {r.grads_match} (bit for bit against {r.grad_reference}"
              + ("; deterministic kernels" if r.deterministic else "") + ")")
        floors = [f for f in r.grad_noise_floor if f is not None]
        if floors and not r.lossy:
            print(f"grad noise    ours differ from the reference by at most {max(r.grad_rel_diff):.3g}; the reference "
                  f"differs from itself by up to {max(floors):.3g} ("
                  + ("the model seeds its generators anew from the operating system, torch.seed(): no replay follows "
                     "its draws" if r.grads_reseeded else "kernels that are not deterministic") + "): "
                  + ("within the noise" if r.grads_within_noise else "beyond it"))
        if r.lossy:
            d = r.grad_rel_diff
            print(f"grad diff     ||ours - reference|| / ||reference|| from the same weights: at most {max(d):.3g} "
                  f"in {len(d)} steps (lossy encodings)")


def cmd_train(args: argparse.Namespace) -> int:
    from . import distributed
    if distributed.world_size() == 1:
        if args.nproc > 1:
            _check_job(args)
            return distributed.launch(args.argv, args.nproc)
        return _train(args)
    try:  # one rank of `--nproc N`
        code = _train(args)
    except OffloadError as exc:
        code = report_error(f"train (rank {distributed.rank()})", exc)
    distributed.finish(code)
    return code


def _check_job(args: argparse.Namespace) -> None:
    """Everything a rank would refuse, refused here before any rank starts: the ranks this
    machine has, the files, the schedule's chain, the batch, the model and its weights."""
    from offload.models.resolve import parse_options

    from . import distributed
    from .train import check_data_parallel
    most, what = distributed.most_ranks(args.device)
    if args.nproc > most:
        raise FormatError(f"--nproc {args.nproc}: this machine has {most} {what}",
                          f"use --nproc {most} or fewer" if most > 1 else "train on one rank (no --nproc)")
    chain = load_chain(args.chain)
    load_schedule(args.schedule, chain)
    check_data_parallel(chain, args.model, args.batch, parse_options(args.option))


def _train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from offload.models.resolve import parse_options

    from . import distributed
    from .train import TrainOptions, train
    speaks = distributed.rank() == 0  # one report for the job
    chain = load_chain(args.chain)
    schedule = load_schedule(args.schedule, chain)
    with tqdm(desc="training", unit="step", file=sys.stderr, disable=args.quiet or not speaks, leave=False) as bar:
        def progress(what: str, total: int) -> None:
            bar.total = total
            bar.set_postfix_str(what, refresh=False)
            bar.update()
        opts = TrainOptions(steps=args.steps, device=args.device, backend=args.backend, optimizer=args.optimizer,
                            lr=args.lr, check_grads=args.check_grads, compare=args.compare, trace=args.trace,
                            op_memory=args.op_memory, progress=progress)
        report, error = train(args.model, chain, schedule, opts, batch=args.batch, options=parse_options(args.option))
    if args.report and speaks:
        write_json(args.report, report.json())
    if speaks:
        _print_report(report)
    if args.report and speaks:
        print(f"wrote {args.report}")
    if error is not None:
        raise error
    if report.grads_within_noise is False and not report.lossy:
        print(f"error: gradients differ from training without offloading (rank {distributed.rank()})")
        return 7
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model with a schedule; measured vs predicted step time and peak",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Train MODEL on synthetic data with SCHEDULE applied: saved activations go to a "
                                   "pinned host arena on a D2H stream, come back on an H2D stream, at exactly the "
                                   "schedule's points. Prints measured step time, peak memory and bytes moved next "
                                   "to the simulator's prediction.",
                       epilog="example:\n  offload profile resnet50 --batch 32 -o c.json\n"
                              "  offload solve c.json --budget 50% -o s.json\n"
                              "  offload train --chain c.json --schedule s.json --steps 20 "
                              "--check-grads --compare --report run.json")
    p.add_argument("model", nargs="?", metavar="MODEL", type=model_input,
                   help="the model the chain was profiled from (default: the one its recipe names)")
    p.add_argument("--chain", required=True, type=input_path, help="chain.json the schedule was solved on")
    p.add_argument("--schedule", required=True, type=input_path, help="schedule.json (refused if made for another chain)")
    p.add_argument("--batch", type=integer(1), help="batch size (must be the chain's; default: the chain's)")
    p.add_argument("-O", "--option", action="append", metavar="KEY=VALUE",
                   help="model option, repeatable (must be the chain's, as profiled; default: the chain's)")
    p.add_argument("--steps", type=integer(1, 100000), default=5, help="training steps (default 5)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="cuda (streams), cpu-eager, or cpu-lazy (copies only when a wait forces them: "
                        "a missing edge shows up as wrong gradients)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the one the chain was profiled with")
    p.add_argument("--lr", type=number(0, 1e3, strict=False, what="a learning rate"), default=1e-4, metavar="LR", help="learning rate (default 1e-4)")
    p.add_argument("--check-grads", action="store_true",
                   help="also train a copy without offloading and compare every gradient bit for bit")
    p.add_argument("--compare", action="store_true",
                   help="also time the same steps without offloading, under torch's save_on_cpu and with "
                        "op-level selective checkpointing of the chain's blocks (matmul outputs saved, the rest "
                        "recomputed: torchtitan's policy), and print our step time as a multiple of each; on a "
                        "chain of the compiled graph each of them runs compiled alike")
    p.add_argument("--trace", metavar="JSON", type=output_path,
                   help="write a torch.profiler Chrome trace of one more step (open in ui.perfetto.dev); on a GPU "
                        "it also reports how much of the copy time ran under compute, and how long the device "
                        "waited for the host and for copies beside the prediction's")
    p.add_argument("--op-memory", action="store_true",
                   help="read memory at every op's end in the first measured step (after the warm-up step) and "
                        "compare each op with the simulator's (report: measured.op_peak_bytes, predicted.op_bytes); "
                        "on a GPU this synchronizes that step at every "
                        "boundary; on a chain of the compiled graph (--whole-graph) the schedule is compiled again with "
                        "marks at its stage boundaries, and a third step of that compile is read")
    p.add_argument("--report", metavar="JSON", type=output_path, help="write the run report here (also when a step fails its budget)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--nproc", type=integer(1, 1024), default=1, metavar="N",
                   help="data-parallel ranks on this machine (through torch.distributed.run: gloo on the CPU, one GPU "
                        "each with NCCL); every rank trains DDP(model) staged with the schedule on its own batch, "
                        "rank 0 reports (default 1)")
    p.set_defaults(func=cmd_train)
