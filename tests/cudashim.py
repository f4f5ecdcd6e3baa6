"""A fake CUDA for the real ``CudaBackend``: its streams, events and copies on CPU tensors.

``CudaBackend`` (offload/executor/backends.py) has only ever run on a GPU, which this
project's machines lack.  ``FakeCuda`` installs stand-ins for ``torch.cuda.Stream``,
``Event``, ``current_stream``, ``stream`` and ``synchronize``, so the backend's own code
runs unchanged on the CPU, and checks what a GPU would do with it:

* **Deferred copies.** A ``copy_`` issued inside ``torch.cuda.stream(side)`` is queued on
  that stream, and its destination is poisoned (NaN bytes) until it runs.  Queued work runs
  as late as the recorded dependencies allow: when the compute stream waits for an event
  recorded after it (or on ``synchronize``).  The compute stream is the Python thread: its
  ops run at once, as kernels would be queued in order.  A missing wait makes the backward
  read poison: wrong gradients, deterministically.
* **Happens-before.** Every stream keeps a vector clock (recording an event copies it,
  waiting merges it), and every storage remembers its last write and its reads per stream
  (the compute stream's through a ``TorchDispatchMode`` over every op).  An access that is
  not ordered after a conflicting access of another stream is a *race*: a D2H reading an
  activation compute had not provably finished, an H2D writing a buffer compute may still
  use, compute reading a prefetched buffer before its H2D, a storage released while its D2H
  may still read it (``released``: no ``record_stream``, so the free is on the compute
  stream).  This is ``torch.cuda._sanitizer``'s idea, on fake streams.

* **Host waits.** An op whose result the host must read back before it can go on (``item``,
  ``nonzero``, ``masked_select``, boolean indexing, ``equal``), or that copies host data up
  (a tensor made from a Python list), would make a GPU's launch thread wait for the device
  and drain the pipeline.  Each one run on the compute stream is listed in ``host_waits``.

Races are collected in ``FakeCuda.races`` (one line each); tests assert there are none,
and that removing any single ordering call from ``CudaBackend`` produces one.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

POISON = 0xFF

Clock = dict[int, int]

# ops that make the host wait for the device: a value read back, or host data copied up
HOST_WAITS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "lift_fresh", "unique",
              "_unique2", "unique_consecutive", "bincount", "repeat_interleave"}


def waits_for_device(func: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether running ``func`` makes the host wait for the device (``HOST_WAITS``, or indexing by
    a boolean mask: its result's size is the mask's count)."""
    name = func.overloadpacket.__name__
    return name in HOST_WAITS or (name.startswith("index") and any(
        isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten((args, kwargs))[0][1:]))


class HostWaits(TorchDispatchMode):
    """The host-waiting ops run in this block, by name (``seen``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if waits_for_device(func, args, kwargs):
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _merge(a: Clock, b: Clock) -> Clock:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class FakeStream:
    """A queue of deferred work (side streams) or the Python thread itself (compute)."""

    def __init__(self, cuda: "FakeCuda", name: str, immediate: bool = False) -> None:
        self.cuda, self.name, self.immediate = cuda, name, immediate
        self.id = len(cuda.streams)
        cuda.streams.append(self)
        self.clock: Clock = {self.id: 1}
        self.queue: list[Callable[[], None]] = []
        self.done = 0  # queue entries run so far

    def tick(self) -> int:
        self.clock[self.id] += 1
        return self.clock[self.id]

    def run_to(self, n: int) -> None:
        """Run the queued work up to entry ``n`` (in order)."""
        while self.done < n:
            work = self.queue[self.done]
            self.done += 1
            work()

    def wait_event(self, event: "FakeEvent") -> None:
        if event.stream is None:  # never recorded: CUDA makes this a no-op
            return
        self.clock = _merge(self.clock, event.clock)
        if self.immediate:
            event.stream.run_to(event.position)
        else:
            source, position = event.stream, event.position
            self.queue.append(lambda: source.run_to(position))

    def synchronize(self) -> None:
        self.run_to(len(self.queue))

    def __repr__(self) -> str:
        return f"<{self.name} stream>"


class FakeEvent:
    def __init__(self, cuda: "FakeCuda") -> None:
        self.cuda = cuda
        self.stream: FakeStream | None = None
        self.position = 0
        self.clock: Clock = {}

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current
        self.stream, self.position, self.clock = stream, len(stream.queue), dict(stream.clock)
        stream.tick()


class _Access:
    """What a storage has seen: its last write and the latest read per stream, each an epoch."""

    def __init__(self) -> None:
        self.write: tuple[int, int] | None = None
        self.reads: dict[int, int] = {}


class _SideCopies(TorchFunctionMode):
    """Inside ``torch.cuda.stream(side)``: ``copy_`` is queued on ``side``, not run."""

    def __init__(self, cuda: "FakeCuda", stream: FakeStream) -> None:
        super().__init__()
        self.cuda, self.stream = cuda, stream

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.copy_:
            return func(*args, **kwargs)
        dst, src = args[0], args[1]
        self.cuda.side_copy(self.stream, dst, src)
        return dst


class _ComputeAccesses(TorchDispatchMode):
    """Every op of the compute stream: its reads and writes, checked and recorded.  The ops of
    the ``offload`` namespace (the copies of a compiled graph) are the runtime's own calls,
    as the eager runtime's Python is: what they issue on the streams is seen, not the ops."""

    def __init__(self, cuda: "FakeCuda") -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "offload":
            return func(*args, **kwargs)
        if not self.cuda.unrecorded and waits_for_device(func, args, kwargs):
            self.cuda.host_waits.append(func.overloadpacket.__name__)
        out = func(*args, **kwargs)
        if self.cuda.unrecorded or func.is_view:  # a view reads no data
            return out
        compute = self.cuda.compute
        epoch = compute.tick()
        written = set()
        for i, arg in enumerate(func._schema.arguments):
            alias = arg.alias_info
            if alias is not None and alias.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in tree_flatten(value)[0]:
                    if isinstance(t, torch.Tensor):
                        written.add(_key(t))
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and _key(t) not in written:
                self.cuda.access(compute, t, "read", epoch, func.__name__)
        for key in written:
            self.cuda.access_key(compute, key, "write", epoch, func.__name__)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and _key(t) not in written:
                self.cuda.access(compute, t, "write", epoch, func.__name__)
        return out


class FakeCuda:
    """Install with ``with FakeCuda(monkeypatch) as cuda:``; run steps; read ``cuda.races``."""

    def __init__(self, monkeypatch: Any, everywhere: bool = True) -> None:
        self.monkeypatch = monkeypatch
        self.everywhere = everywhere  # False: the compute stream's accesses are seen in ``tracked`` blocks only
        self.streams: list[FakeStream] = []
        self.compute = FakeStream(self, "compute", immediate=True)
        self.current = self.compute
        self.memory: dict[int, _Access] = {}
        self.races: list[str] = []
        self.unrecorded = False
        self.copies_issued = self.copies_run = 0
        self.synchronizations = 0  # whole-device waits: none in a step (they end the CPU's lead)
        self.host_waits: list[str] = []  # ops of the compute stream that read a device value back

    # -- torch.cuda stand-ins
    def _stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        return FakeStream(self, f"side{len(self.streams)}")

    def _current_stream(self, device: Any = None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def _use(self, stream: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            if stream is self.compute:
                yield
            else:
                with _SideCopies(self, stream):
                    yield
        finally:
            self.current = previous

    def _synchronize(self, device: Any = None) -> None:
        self.synchronizations += 1
        for s in self.streams:
            s.synchronize()
            self.compute.clock = _merge(self.compute.clock, s.clock)

    def __enter__(self) -> "FakeCuda":
        mp = self.monkeypatch
        mp.setattr(torch.cuda, "Stream", self._stream)
        mp.setattr(torch.cuda, "Event", lambda **_: FakeEvent(self))
        mp.setattr(torch.cuda, "current_stream", self._current_stream)
        mp.setattr(torch.cuda, "stream", self._use)
        mp.setattr(torch.cuda, "synchronize", self._synchronize)
        self._mode = _ComputeAccesses(self)
        if self.everywhere:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.everywhere:
            self._mode.__exit__(*exc)

    @contextlib.contextmanager
    def tracked(self) -> Iterator[None]:
        """The compute stream's accesses seen in this block (``everywhere=False``: Dynamo runs no
        compiled frame under a dispatch mode, so a compiled graph is tracked from inside)."""
        with _ComputeAccesses(self):
            yield

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Ops in this block are not the compute stream's (a reference run, the fake's own
        poison and queued copies): not recorded."""
        previous, self.unrecorded = self.unrecorded, True
        try:
            yield
        finally:
            self.unrecorded = previous

    # -- copies and accesses
    def side_copy(self, stream: FakeStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on ``stream``: checked now (its place in the stream's
        order), run later; ``dst`` reads as poison until then."""
        epoch = stream.tick()
        # keyed by where each side starts: the host slots are views of the arena's one chunk, and two
        # units' slots are two places to a copy engine (a whole device storage starts where its view does)
        self.access_key(stream, src.data_ptr(), "read", epoch, "copy_")
        self.access_key(stream, dst.data_ptr(), "write", epoch, "copy_")
        self.copies_issued += 1
        with self.outside():  # the poison is the fake's, not a compute op
            dst.view(torch.uint8).fill_(POISON)

        def run() -> None:
            with self.outside():
                dst.copy_(src)
            self.copies_run += 1
        stream.queue.append(run)

    def access(self, stream: FakeStream, t: torch.Tensor, kind: str, epoch: int, what: str) -> None:
        if t.is_sparse or t.untyped_storage().nbytes() == 0:
            return
        self.access_key(stream, _key(t), kind, epoch, what)

    def access_key(self, stream: FakeStream, key: int, kind: str, epoch: int, what: str) -> None:
        record = self.memory.setdefault(key, _Access())
        seen = stream.clock
        if record.write is not None:
            by, at = record.write
            if by != stream.id and seen.get(by, 0) < at:
                self.races.append(f"{stream.name} {kind}s ({what}) a storage {self.streams[by].name} wrote, "
                                  "without waiting for it")
        if kind == "write":
            for by, at in record.reads.items():
                if by != stream.id and seen.get(by, 0) < at:
                    self.races.append(f"{stream.name} writes ({what}) a storage {self.streams[by].name} reads, "
                                      "without waiting for it")
            record.write, record.reads = (stream.id, epoch), {}
        else:
            record.reads[stream.id] = max(record.reads.get(stream.id, 0), epoch)

    def freed(self, t: torch.Tensor) -> None:
        """The compute stream drops ``t``'s storage (the block can be reused by the next kernel)."""
        self.access(self.compute, t, "write", self.compute.tick(), "free")


class FakeAllocator:
    """The caching allocator's counters as ``CudaMeter`` reads them, on made-up numbers:
    ``allocate``/``free`` move the bytes in use, the cache holds ``reserved`` bytes in one
    segment whose unused part is one free block.  Set ``sticky`` and every call raises as
    CUDA does after an illegal memory access, so nothing may touch the device any more."""

    def __init__(self, monkeypatch: Any, allocated: int, peak: int, reserved: int) -> None:
        self.allocated, self.peak, self.reserved, self.reserved_peak = allocated, peak, reserved, reserved
        self.sticky = False
        self.touched: list[int] = []
        from offload.core import meters
        for name in ("synchronize", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
                     "max_memory_reserved", "memory_snapshot", "current_stream", "current_device"):
            monkeypatch.setattr(torch.cuda, name, self._guarded(getattr(self, "_" + name)))
        monkeypatch.setattr(meters, "_touch", self._guarded(self._touch))

    def _guarded(self, call: Callable) -> Callable:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.sticky:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return call(*args, **kwargs)
        return guarded

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        if self.allocated > self.reserved:  # the cache grows by what it lacks
            self.reserved = self.allocated
        self.peak, self.reserved_peak = max(self.peak, self.allocated), max(self.reserved_peak, self.reserved)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def _touch(self, device: Any, nbytes: int) -> None:
        self.touched.append(nbytes)
        self.allocate(nbytes)
        self.free(nbytes)

    def _synchronize(self, device: Any = None) -> None:
        pass

    def _memory_allocated(self, device: Any = None) -> int:
        return self.allocated

    def _max_memory_allocated(self, device: Any = None) -> int:
        return self.peak

    def _max_memory_reserved(self, device: Any = None) -> int:
        return self.reserved_peak

    def _reset_peak_memory_stats(self, device: Any = None) -> None:
        self.peak, self.reserved_peak = self.allocated, self.reserved

    def _memory_snapshot(self) -> list[dict]:
        free = self.reserved - self.allocated
        blocks = [{"size": self.allocated, "state": "active_allocated"}] + (
            [{"size": free, "state": "inactive"}] if free else [])
        return [{"device": 0, "stream": 0, "segment_type": "large", "blocks": blocks}]

    def _current_stream(self, device: Any = None) -> Any:
        return type("Stream", (), {"cuda_stream": 0})()

    def _current_device(self) -> int:
        return 0
