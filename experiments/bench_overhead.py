"""Executor overhead benchmark: the host time ``Offloaded`` adds per step and per saved tensor.

Every saved tensor passes through Python pack/unpack hooks and the runtime's bookkeeping,
and every stage boundary through an autograd function and the plan's events.  The
simulator counts none of it (issue #33); on a GPU it is host time that a device waiting for
kernels pays.  This measures it where it is plain to see, on a model of tiny ops (a GPT of
width 32: the ops take microseconds, so the hooks are a large share), training steps of
the same module, interleaved so that a loaded machine slows all alike:

* ``plain``: the module;
* ``hooks``: the module under identity ``saved_tensors_hooks`` (autograd's own cost of a hook);
* ``offloaded, empty``: ``Offloaded`` with a schedule that moves nothing (tracking and staging);
* ``offloaded, floor``: ``Offloaded`` moving the units of the floor schedule (copies, slots);
* ``recomputed, whole`` and ``recomputed, in part`` (``--model llama``): every block
  re-run whole, then in part (its ``matmuls`` in-stage option: the kept ops' outputs
  recorded in the forward and served to the re-run by a dispatch mode, which every op of
  the stage passes through twice).

Prints each one's median step, its ratio to ``plain`` and the overhead per saved tensor::

    python -m experiments.bench_overhead                  # the default tiny GPT
    python -m experiments.bench_overhead --layers 12 --width 64
    python -m experiments.bench_overhead --model llama   # the transformers Llama in bf16 autocast

``--hooks`` times the executor's pack and unpack hooks themselves, call by call, on the
device (cuda where there is one), for each saved tensor a unit keeps and each one it hands
to the runtime (moved, or rebuilt by a re-run: the schedules that move the floor's units
and that re-run every block): the per-tensor host time a handled unit adds, which the
chain's profiled times (kept units only) do not hold (issue #33)::

    python -m experiments.bench_overhead --hooks --model llama

``--copies`` measures instead the host's time per storage the executor moves (what the
profiler writes as the chain's ``copy_host_s``: ``offload.executor.copy_cost``), on CUDA
where there is one: a unit's copies issued as one batch, as the executor issues them, and
one copy call per storage, as it did before (each with its own events, stream switch and
wait; on an H200 the ResNet-50 joint row's stages took 75-146 us a storage moved)::

    python -m experiments.bench_overhead --copies        # make gpu-bench runs it on the GPU
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments.bench_executor import machine_name
from offload.core.devices import pick_device
from offload.executor import Offloaded
from offload.executor.backends import make_backend
from offload.executor.copy_cost import copy_host_seconds
from offload.executor.step_costs import KINDS, step_costs
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.step.actions import Recompute
from offload.step.chain import MATMULS
from offload.step.memory import floor_offloads
from offload.step.schedule import make_schedule


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                    help="gpt (default), or the transformers Llama (bf16 autocast, SDPA, dropout 0.1)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="timed steps of each way, interleaved (40)")
    ap.add_argument("--hooks", action="store_true",
                    help="the host's time per call of the executor's pack and unpack hooks, kept and handled tensors "
                         "(cuda if available)")
    ap.add_argument("--copies", action="store_true",
                    help="the host's time per storage copied, batched and one call per storage (cuda if available)")
    args = ap.parse_args(argv)
    if args.copies:
        return _copies()
    options = {"layers": args.layers, "width": args.width, "heads": 4, "seq": args.seq, "vocab": 64}
    autocast = "bfloat16" if args.model == "llama" else None
    if args.model == "llama":
        options.update(kv_heads=2, dropout=0.1)
    if args.hooks:
        return _hooks(args.model, options, autocast, args.batch, args.steps)
    chain = profile(args.model, ProfileOptions(batch=args.batch, repeats=1, warmup=1, device="cpu", options=options,
                                               autocast=autocast)).chain
    spec = resolve(args.model, args.batch, options)
    spec.autocast = autocast
    saved = [0]

    def counting(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    def step(forward) -> None:
        with spec.autocasting():
            loss = spec.loss(forward(*spec.args, **spec.kwargs))
        loss.backward()

    def hooked(*a, **k):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return spec.module(*a, **k)
    with torch.autograd.graph.saved_tensors_hooks(counting, lambda t: t):
        step(spec.module)
    ways = {"plain": spec.module, "hooks": hooked,
            "offloaded, empty": Offloaded(spec.module, chain, make_schedule(chain, []), backend="cpu-eager"),
            "offloaded, floor": Offloaded(spec.module, chain, make_schedule(chain, floor_offloads(chain)),
                                          backend="cpu-eager")}
    if chain.optional:  # the Llama's blocks re-run whole, then in part (their kept ops' outputs recorded and served)
        blocks = sorted({i for i, _ in chain.optional})
        for name, option in (("recomputed, whole", ""), ("recomputed, in part", MATMULS)):
            ways[name] = Offloaded(spec.module, chain, make_schedule(chain, [], [Recompute(i, i, option) for i in blocks]),
                                   backend="cpu-eager")
    times: dict[str, list[float]] = {name: [] for name in ways}
    for name, forward in ways.items():  # warm-up
        step(forward)
    for _ in range(args.steps):
        for name, forward in ways.items():
            t0 = time.perf_counter()
            step(forward)
            times[name].append(time.perf_counter() - t0)
    plain = statistics.median(times["plain"])
    print(f"{args.model}, {args.layers} layers, width {args.width}, batch {args.batch}, seq {args.seq}: {chain.L} stages, "
          f"{saved[0]} saved tensors per step; {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'way':<20} {'median step':>12} {'x plain':>8} {'per saved tensor':>17}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<20} {med * 1e3:>9.2f} ms {med / plain:>8.2f} {(med - plain) / saved[0] * 1e6:>14.1f} us")
    return 0


class _OneByOne:
    """A backend's batches issued one copy call per storage, as the executor issued them before
    ce1aa50: each copy with its own events, stream switch and wait."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def d2h_many(self, items: list) -> list:
        return [self.backend.d2h(*item) for item in items]

    def h2d_many(self, items: list) -> list:
        return [self.backend.h2d(*item) for item in items]

    def wait_many(self, copies: list) -> None:
        for copy in copies:
            self.backend.wait(copy)


def _hooks(model: str, options: dict, autocast: str | None, batch: int, steps: int) -> int:
    device = pick_device(None)
    chain = profile(model, ProfileOptions(batch=batch, repeats=1, warmup=1, device=device.type, options=options,
                                          autocast=autocast, encodings=False)).chain
    spec = resolve(model, batch, options)
    spec.autocast = autocast
    spec.place(device, torch.float32)
    print(f"the executor's hooks, host time per call (median of {steps} steps; the timer's own cost included): "
          f"{model}, {chain.L} stages, {machine_name(device.type)}")
    print(f"{'schedule':<20}" + "".join(f"{k:>20}" for k in KINDS))
    costs = step_costs(spec, chain, steps)
    for name, calls in costs.calls.items():
        cells = [f"{statistics.median(calls[k]) * 1e6:6.1f} us x{len(calls[k]) // steps:<4}" if calls[k] else "-"
                 for k in KINDS]
        print(f"{name:<20}" + "".join(f"{c:>20}" for c in cells))
    print(f"handle_host_s, as the profiler writes it on CUDA (handle_device_s on a CPU): "
          f"{costs.handled_seconds() * 1e6:.1f} us per handled tensor, each way")
    return 0


def _copies() -> int:
    device = pick_device(None)
    backend = make_backend(None, device)
    print(f"the executor's host time per storage copied, each way ({backend.name} backend, 8 units of 16 storages "
          f"of 64 KiB, median of 5 rounds; {machine_name(device.type)}):")
    copy_host_seconds(device, backend=backend, repeats=1)  # the process's first allocations and copies, untimed
    for name, way in (("one batch per unit", backend), ("one call per storage", _OneByOne(backend))):
        seconds = copy_host_seconds(device, backend=way)
        print(f"  {name:<22} {seconds * 1e6:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
