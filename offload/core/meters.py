"""Memory and time readings at stage boundaries, on CUDA and on the CPU.

A meter answers two questions at each boundary: how many bytes are live now, and what was
the most live since the last boundary.  On CUDA the caching allocator's counters answer
them (``memory_allocated`` / ``max_memory_allocated``, so cuDNN/cuBLAS workspaces count).
The CPU has no such counters, so ``CpuMeter`` keeps exact tensor accounting: a
``TorchDispatchMode`` sees every op's outputs, registers each new storage once (one made
from Python data too, which reaches the dispatcher through ``lift_fresh``), and a
``weakref.finalize`` on the storage (PyTorch keeps one Python object per live storage)
subtracts it when it is really freed, whoever held it (autograd's saved tensors included);
a storage resized in place (``inductor.resize_storage_bytes_``) counts its new size.
Its peak is exact at op granularity; workspace inside a CPU kernel is not seen.  It also
counts the ops it sees, and says at which op each interval's peak was reached
(``peak_op``), which the profiler's holding pass compares with when storages died.

While a meter runs, Python's collector does not (``_CollectorPaused``): what a reference cycle
of the model's own holds (a TimeSeriesTransformer's output distribution holds its scaler's
outputs) lives to the end of the step, the longest it can, whatever moment the collector
would have run, which follows every allocation of Python objects before it: the profile and
the run read 16 B more or less from one another.  A step that collects sooner holds less.

A clock takes timestamps at the same boundaries: CUDA events on the current stream (no
synchronisation inside the step), ``perf_counter`` on the CPU, where ops are synchronous.
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from offload.io.text import native_output_discarded


_host = threading.local()
_RESIZE = torch.ops.inductor.resize_storage_bytes_.default  # what the executor resizes storages with
# a tensor made from Python data (``torch.tensor([-2])``, an index list) is allocated outside
# the dispatcher, then handed to it through these: new storage, though it is their input's
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default)
# an alias without autograd history allocates nothing, and the pack hooks make one of each saved
# output they keep (``core.casts.kept``): no op of the model's that a pass numbers, so that passes
# whose hooks keep more or fewer saved tensors number the model's ops alike
UNCOUNTED = torch.ops.aten.detach.default


def timed(fn: Callable[[], Any], sync: Callable[[], None], repeats: int = 3) -> tuple[Any, float]:
    """``fn()``'s last result and its median wall time over ``repeats`` calls, each between
    two ``sync()`` (a device synchronisation: outside a step only)."""
    times, out = [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


@contextlib.contextmanager
def host_allocation() -> Iterator[None]:
    """Tensors made in this block are host memory (the executor's arena), never counted as
    device memory by a ``CpuMeter``, even when the CPU is also the device."""
    previous = getattr(_host, "active", False)
    _host.active = True
    try:
        yield
    finally:
        _host.active = previous


class _CollectorPaused:
    """Every meter: Python's collector off while it runs (module docstring), back on after it
    as it was (a meter inside another leaves it off)."""

    _collecting = False  # the collector was on as the meter began

    def _pause(self) -> None:
        self._collecting = gc.isenabled()
        gc.disable()

    def _resume(self) -> None:
        if self._collecting:
            gc.enable()


class CpuMeter(_CollectorPaused, TorchDispatchMode):
    """Exact live-bytes accounting of CPU tensors; enter it around the measured step.

    ``torch.compile`` runs no frame under a dispatch mode, and a frame it first meets under
    one it marks to run uncompiled for good: so inside the meter compiled code runs eager by
    ``torch.compiler.set_stance("force_eager")``, which leaves its compiled frames as they
    were for the steps after the meter (a compiled model metered once trained uncompiled
    from then on: the timed steps of ``offload train``, the user's own after ``measured()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.ops = 0  # ops seen so far
        self.peak_op = 0  # the op at which the current interval's peak was reached
        self.interval_peak_op = 0  # the same, for the interval the last boundary() closed
        self.trace: list[int] | None = None  # when a list: the live bytes as each op has made its outputs
        self._tracked: dict[int, int] = {}  # storage key -> nbytes
        self._ignored: set[int] = set()
        self.reserved_peak: int | None = None  # no allocator holds more than the tensors: nothing to report
        self._finalizers: list[weakref.finalize] = []
        self._eager = contextlib.ExitStack()

    def __enter__(self) -> "CpuMeter":
        self._pause()
        self._eager.enter_context(torch.compiler.set_stance("force_eager"))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._eager.close()
            self._resume()

    def track(self, tensors: Iterable[Any]) -> None:
        """Count tensors that exist before the step (weights, gradients, optimizer state, inputs)."""
        for t in _held(tensors):
            self._register(t)

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these storages (the executor's host arena is host memory, not device memory)."""
        for t in _held(tensors):
            self._ignore(t)

    def _ignore(self, t: torch.Tensor) -> None:
        """Ignore ``t``'s storage while it lives: its address may later be another storage's."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._ignored:
            self._ignored.add(key)
            self._finalizers.append(weakref.finalize(storage, self._ignored.discard, key))

    def _register(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = storage._cdata
        if nbytes == 0 or key in self._tracked or key in self._ignored:
            return
        self._tracked[key] = nbytes
        self._grow(nbytes)
        self._finalizers.append(weakref.finalize(storage, self._free, key))

    def _grow(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, self.ops

    def _free(self, key: int) -> None:
        self.live -= self._tracked.pop(key, 0)

    def _resized(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        if key in self._tracked:
            nbytes = t.untyped_storage().nbytes()
            self._grow(nbytes - self._tracked[key])
            self._tracked[key] = nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is UNCOUNTED:
            return func(*args, **(kwargs or {}))
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        if func is _RESIZE:  # a storage resized in place (a held part taken off the device or back)
            self._resized(args[0])
        made = _held(tree_flatten(out)[0])
        if getattr(_host, "active", False):  # host memory that stands in for pinned memory
            for t in made:
                self._ignore(t)
            return out
        inputs = {t.untyped_storage()._cdata for t in _held(tree_flatten((args, kwargs))[0])}
        for t in made:
            key = t.untyped_storage()._cdata
            if key in inputs and key not in self._tracked and func not in _LIFTS:
                self._ignore(t)  # a view of a tensor from before the step: not allocated here
            else:
                self._register(t)
        if self.trace is not None:
            self.trace.append(self.live)
        return out

    @property
    def untracked(self) -> int:
        """Live bytes that no tracked or counted tensor holds: none, by construction."""
        return 0

    def boundary(self) -> tuple[int, int]:
        """(peak since the last boundary, live now); starts the next interval."""
        peak, self.peak = self.peak, self.live
        self.interval_peak_op, self.peak_op = self.peak_op, self.ops
        return peak, self.live

    def close(self) -> None:
        """Stop watching storages (the finalizers would otherwise outlive the meter)."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._tracked.clear()


_PARTS = {torch.sparse_coo: ("_indices", "_values"), torch.sparse_csr: ("crow_indices", "col_indices", "values"),
          torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
          torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
          torch.sparse_bsc: ("ccol_indices", "row_indices", "values")}


def _held(objects: Iterable[Any]) -> list[torch.Tensor]:
    """The strided CPU tensors whose storages hold the bytes of the tensors in ``objects``: a
    sparse tensor has no storage of its own, its index and value tensors do."""
    out = []
    for t in objects:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        if t.layout == torch.strided:
            out.append(t)
        else:
            out.extend(_held(getattr(t, part)() for part in _PARTS.get(t.layout, ())))
    return out


class CudaMeter(_CollectorPaused):
    """The CUDA caching allocator's counters (all tensors on the device, workspaces included).

    An interval's peak needs the allocator's peak counters reset at each boundary, and those
    counters are the process's: a user who reads ``torch.cuda.max_memory_allocated()`` after a
    metered block would get the block's last interval.  So the meter notes the peak the
    device had before its first reset, and on a clean exit raises the counter back to the
    larger of that and its own highest reading, with one allocation freed at once, served
    from a free block of the allocator's cache (no new device memory; without one it warns
    instead).  After a failure it touches nothing: a CUDA error is sticky, and another call
    would raise over the original.  ``reserved_peak`` is the most the allocator held from
    the device meanwhile (its slack included: what ``nvidia-smi`` sees of this process)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reserved_peak: int | None = 0
        self._prior: int | None = None  # the allocated-bytes peak before the meter's first reset
        self._highest = 0  # the meter's highest reading
        self._tracked: dict[int, int] = {}  # storage address -> bytes, of the tensors named by ``track``

    def track(self, tensors: Iterable[Any]) -> None:
        """The allocator already counts these; their bytes are noted so that ``untracked`` can
        tell what it holds beyond them."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.layout == torch.strided:
                storage = t.untyped_storage()
                self._tracked.setdefault(storage.data_ptr(), storage.nbytes())

    @property
    def untracked(self) -> int:
        """Bytes the allocator holds now beyond the tracked tensors: cuBLAS/cuDNN workspaces
        (made on their first use, then kept), its rounding of every block, and whatever else
        holds device memory without a tensor the caller named."""
        return self.live - sum(self._tracked.values())

    def ignore(self, tensors: Iterable[Any]) -> None:
        """Pinned host memory is not in the allocator's counters; device tensors are, and cannot
        be left out of them: they are noted as known, like tracked ones."""
        self.track(tensors)

    @property
    def live(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def _reset(self) -> None:
        if self._prior is None:
            self._prior = torch.cuda.max_memory_allocated(self.device)
        self._note_reserved()
        torch.cuda.reset_peak_memory_stats(self.device)

    def _note_reserved(self) -> None:
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved(self.device))

    def boundary(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self._highest = max(self._highest, peak)
        self._reset()
        return peak, self.live

    def __enter__(self) -> "CudaMeter":
        self._pause()
        torch.cuda.synchronize(self.device)
        self._reset()
        return self

    def __exit__(self, failed: type | None, *exc: Any) -> None:
        self._resume()
        if failed is None:
            self._restore_peak()

    def _restore_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        self._note_reserved()
        target = max(self._prior or 0, self._highest)
        need = target - torch.cuda.memory_allocated(self.device)
        if need <= 0 or torch.cuda.max_memory_allocated(self.device) >= target:
            return
        if not _cached_block_fits(self.device, need):
            # one message whatever the bytes: Python then shows it once, not after every metered step
            warnings.warn("the allocator's peak counters were reset to meter each op, and no free cached block could "
                          "raise them back: torch.cuda.max_memory_allocated() now reports less than the device's "
                          "peak before and during the metered steps", stacklevel=3)
            return
        _touch(self.device, need)

    def close(self) -> None:
        pass


def _cached_block_fits(device: torch.device, nbytes: int) -> bool:
    """Whether the allocator can serve ``nbytes`` on the current stream from a free cached
    block, without asking the device for more (blocks up to 1 MiB come from the small pool)."""
    pool = "small" if nbytes <= 1 << 20 else "large"
    stream = torch.cuda.current_stream(device).cuda_stream
    index = device.index if device.index is not None else torch.cuda.current_device()
    return any(block["state"] == "inactive" and block["size"] >= nbytes
               for segment in torch.cuda.memory_snapshot()
               if segment.get("device", index) == index and segment.get("stream", stream) == stream
               and segment.get("segment_type") == pool
               for block in segment["blocks"])


def _touch(device: torch.device, nbytes: int) -> None:
    """Allocate ``nbytes`` on the device and free them: the peak counter now includes them."""
    torch.empty(nbytes, dtype=torch.uint8, device=device)


class Clock:
    """Timestamps at boundaries; ``intervals()`` gives the seconds between consecutive marks.
    On CUDA the host's own times are noted too (``host_intervals``): when it had issued each
    interval's work, which the device may be waiting for."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.marks: list[Any] = []
        self.host_marks: list[float] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))  # this device's, whichever is current
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
        self.host_marks.append(time.perf_counter())

    def host_intervals(self) -> list[float]:
        """Seconds the host took to issue each interval's work: on the CPU none (0), its ops run
        as they are issued, ``intervals`` already are the host's."""
        if not self.cuda:
            return [0.0] * (len(self.marks) - 1)
        return [b - a for a, b in zip(self.host_marks, self.host_marks[1:])]

    def intervals(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class QuietProfile(torch.profiler.profile):
    """``torch.profiler.profile`` that prints nothing as it starts and stops: torch 2.13's kineto
    writes "USDT: ... profiler_start" and "profiler_stop" lines to the process's stderr from C++,
    which land in a command's own output each time a compiled step is metered."""

    def start(self) -> None:
        with native_output_discarded(2):
            super().start()

    def stop(self) -> None:
        with native_output_discarded(2):
            super().stop()


class AllocationMeter(_CollectorPaused):
    """The CPU allocator's allocations, from ``torch.profiler``'s memory events, for code that
    bypasses the dispatcher in Python (a compiled graph's kernels allocate in C++, where a
    ``CpuMeter`` sees nothing).  It counts what is allocated between two boundaries, and only
    that: the first boundary starts the count (live 0), the second ends it with the interval's
    peak and what is still live, relative to the first; tensors from before are not counted,
    ``track`` and ``ignore`` have nothing to do.  Used for one interval per step (the trainer
    reads a step's start and end); its events are read as the interval ends."""

    def __init__(self) -> None:
        self.live = 0
        self.reserved_peak: int | None = None
        self._profiler: torch.profiler.profile | None = None

    def track(self, tensors: Iterable[Any]) -> None:
        pass

    def ignore(self, tensors: Iterable[Any]) -> None:
        pass

    @property
    def untracked(self) -> int:
        return 0

    def boundary(self) -> tuple[int, int]:
        """(peak since the last boundary, live now), relative to the first boundary."""
        if self._profiler is None:
            self._profiler = QuietProfile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._profiler.start()
            return 0, 0
        self._profiler.stop()
        totals = [total for _, total in cpu_allocations(self._profiler)]
        self._profiler = None
        self.live = totals[-1] if totals else 0
        return max([0, *totals]), self.live

    def __enter__(self) -> "AllocationMeter":
        self._pause()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._resume()
        self.close()

    def close(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None


def chrome_trace(prof: Any) -> str:
    """A finished ``torch.profiler.profile``'s Chrome trace, as text (the profiler exports to a
    path only); ``json.loads(text)["traceEvents"]`` are its events."""
    with tempfile.TemporaryDirectory() as scratch:
        exported = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(exported))
        return exported.read_text()


def cpu_allocations(prof: Any, events: list[dict] | None = None) -> list[tuple[float, int]]:
    """A finished ``torch.profiler.profile(profile_memory=True)``'s CPU memory events, in time
    order: (time in us, bytes allocated then over the profile's start).  ``events``: its
    trace's, when already read.

    An event's ``Total Allocated`` is the CPU allocator's running count of the blocks it saw
    allocated while any profile ran, less their frees seen while one ran: a block allocated
    under an earlier profile and freed between profiles stays in it, so the count starts each
    profile at what the process ran before.  The level at this profile's start is the first
    event's count less that event's own ``Bytes``; every total is taken over it."""
    if events is None:
        events = json.loads(chrome_trace(prof))["traceEvents"]
    memory = sorted((float(e["ts"]), int(e["args"]["Total Allocated"]), int(e["args"]["Bytes"])) for e in events
                    if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    start = memory[0][1] - memory[0][2] if memory else 0
    return [(ts, total - start) for ts, total, _ in memory]


def allocated_peak(run_step: Callable[[], Any], device: torch.device) -> int:
    """The most bytes the device's allocator held during ``run_step()`` beyond those it held as
    it began: on a GPU the caching allocator's counters, on the CPU ``torch.profiler``'s memory
    events (every allocation, a compiled kernel's included: a ``CpuMeter`` sees only the ops
    that pass through the dispatcher in Python)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    meter = AllocationMeter()
    with meter:
        meter.boundary()
        run_step()
        return meter.boundary()[0]


def make_meter(device: torch.device, compiled: bool = False) -> CpuMeter | CudaMeter | AllocationMeter:
    """The meter of ``device``'s memory; ``compiled``: of a compiled graph's (on the CPU, its
    allocations: ``AllocationMeter``)."""
    if device.type == "cuda":
        return CudaMeter(device)
    return AllocationMeter() if compiled else CpuMeter()
