"""Where the copies run: CUDA streams, or the CPU (eager or lazy).

The runtime asks a backend for five things: D2H copies of storages into host slots, H2D
copies from the slots into device buffers (after those D2H), a *wait* of the compute
stream for copies, a device buffer, and a storage that the model's own code holds taken
off the device and given its memory back (``evict``, ``restore``: a held part, resized in
place, so that the model's tensors see their bytes again after the H2D copy).  The stream/event rules (docs/executor.md) live in ``CudaBackend``:

* D2H on its own stream, after an event recorded on the compute stream *as it is now*
  (queried live, never cached), and after the slot's last H2D (its guard);
* the compute stream waits for the D2H event before the runtime drops the GPU reference
  (so the allocator reuses the block only after the copy); no ``record_stream``;
* prefetch buffers are allocated on the compute stream; the H2D stream waits for the
  compute stream and for the D2H event; the compute stream waits for the H2D event before
  the consuming backward;
* a held part is evicted on the compute stream after it waited for the D2H event, and
  restored (allocated) on the compute stream before its H2D copy, which the forward that
  reads it waits for.

A unit's storages are copied as one batch (``d2h_many``, ``h2d_many``): on CUDA one event
before and one after the batch, where a copy each would cost the host its events, stream
switches and waits for every storage (the executor's host time per moved storage is in the
model: ``Platform.copy_host_s``, measured by ``copy_host_seconds``).

``CpuEagerBackend`` runs every copy at once.  ``CpuLazyBackend`` runs a copy only when a
wait (or an H2D that depends on it) forces it, and poisons what it hands out (device
buffers before their H2D, host slots before their D2H, and released device storages), so a
missing synchronization edge reads poison and gives wrong gradients, deterministically.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from offload.step import names

POISON = 0xFF  # every float made of these bytes is a NaN


@dataclass
class Copy:
    """One issued copy: what the compute stream waits on, and what it keeps alive."""

    direction: str
    nbytes: int
    event: Any = None  # CUDA event
    run: Callable[[], None] | None = None  # pending work (lazy CPU)
    keep: list[torch.Tensor] = field(default_factory=list)
    after: "Copy | None" = None

    def force(self) -> None:
        """Run a pending (lazy) copy now, its dependency first."""
        if self.after is not None:
            self.after.force()
        if self.run is not None:
            run, self.run = self.run, None
            run()


class CpuEagerBackend:
    """The same protocol on the CPU, each copy done when issued."""

    name = "cpu-eager"
    pin = False  # host slots in pinned memory
    gpu = False  # the step's kernels are launched ahead of a device: a host read of device data stalls them

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def d2h(self, src: torch.Tensor, slot: torch.Tensor, guard: Copy | None) -> Copy:
        slot.copy_(src)
        return Copy("d2h", src.numel())

    def h2d(self, slot: torch.Tensor, dst: torch.Tensor, after: Copy) -> Copy:
        dst.copy_(slot)
        return Copy("h2d", dst.numel(), after=after)

    def wait(self, copy: Copy) -> None:
        copy.force()

    def d2h_many(self, items: list[tuple[torch.Tensor, torch.Tensor, Copy | None]]) -> list[Copy]:
        """``d2h`` of each (source, slot, guard)."""
        return [self.d2h(*item) for item in items]

    def h2d_many(self, items: list[tuple[torch.Tensor, torch.Tensor, Copy]]) -> list[Copy]:
        """``h2d`` of each (slot, destination, after)."""
        return [self.h2d(*item) for item in items]

    def wait_many(self, copies: list[Copy]) -> None:
        for copy in copies:
            self.wait(copy)

    def evict(self, held: torch.Tensor) -> None:
        """Free the memory of a storage the model's own code still holds (its D2H waited for)."""
        _resize(held, 0)

    def restore(self, held: torch.Tensor, nbytes: int) -> None:
        """Give an evicted storage its memory again, for its H2D copy."""
        _resize(held, nbytes)

    def released(self, src: torch.Tensor) -> None:
        """The runtime dropped its reference to a device storage (after waiting for its D2H)."""

    def synchronize(self) -> None:
        pass


class CpuLazyBackend(CpuEagerBackend):
    """Copies run only when forced; poison marks everything not yet legitimately written."""

    name = "cpu-lazy"

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), POISON, dtype=torch.uint8, device=self.device)

    def d2h(self, src: torch.Tensor, slot: torch.Tensor, guard: Copy | None) -> Copy:
        slot.fill_(POISON)
        if guard is not None:
            guard.force()  # the slot's last reader must be done before it is overwritten
        return Copy("d2h", src.numel(), run=lambda: slot.copy_(src), keep=[src])

    def h2d(self, slot: torch.Tensor, dst: torch.Tensor, after: Copy) -> Copy:
        return Copy("h2d", dst.numel(), run=lambda: dst.copy_(slot), after=after)

    def restore(self, held: torch.Tensor, nbytes: int) -> None:
        super().restore(held, nbytes)
        held.fill_(POISON)  # what the allocator hands out: read before its H2D, it poisons the gradients

    def released(self, src: torch.Tensor) -> None:
        """What an allocator reusing the block would leave there, if the block is freed: not when
        the model's own code still holds the storage (then nothing is freed, on a GPU either)."""
        storage = src.untyped_storage()
        if torch._C._storage_Use_Count(storage._cdata) <= 2:  # ``src`` and ``storage`` here
            src.fill_(POISON)


class CudaBackend:
    """Side streams and events on one CUDA device."""

    name = "cuda"
    pin = True
    gpu = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)
        self.compute_stream = torch.cuda.current_stream(device)

    def _compute(self) -> torch.cuda.Stream:
        """The compute stream, checked: the events order copies against one stream, the one
        current when the executor was built (autograd runs each backward op on its forward's)."""
        current = torch.cuda.current_stream(self.device)
        if current != self.compute_stream:
            raise RuntimeError(f"the model runs on {current}, the executor was built on {self.compute_stream}: "
                               "offloading orders its copies against one compute stream; run the forward and "
                               "backward on the stream that was current when Offloaded was built")
        return current

    def empty(self, nbytes: int) -> torch.Tensor:
        self._compute()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # on the compute stream

    def _after_compute(self, stream: torch.cuda.Stream) -> None:
        ev = torch.cuda.Event()
        ev.record(self._compute())  # live, never cached
        stream.wait_event(ev)

    def d2h(self, src: torch.Tensor, slot: torch.Tensor, guard: Copy | None) -> Copy:
        return self.d2h_many([(src, slot, guard)])[0]

    def h2d(self, slot: torch.Tensor, dst: torch.Tensor, after: Copy) -> Copy:
        return self.h2d_many([(slot, dst, after)])[0]

    def d2h_many(self, items: list[tuple[torch.Tensor, torch.Tensor, Copy | None]]) -> list[Copy]:
        """The copies of a batch on the D2H stream, after the compute stream as it is now and
        after each slot's last H2D; one event when all are done."""
        self._after_compute(self.d2h_stream)
        for event in _distinct(guard.event for _, _, guard in items if guard is not None):
            self.d2h_stream.wait_event(event)
        with torch.cuda.stream(self.d2h_stream):
            for src, slot, _ in items:
                slot.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.d2h_stream)
        return [Copy("d2h", src.numel(), event=done, keep=[src]) for src, _, _ in items]

    def h2d_many(self, items: list[tuple[torch.Tensor, torch.Tensor, Copy]]) -> list[Copy]:
        """The copies of a batch on the H2D stream, after the compute stream as it is now (the
        buffers were allocated there) and after each slot's D2H; one event when all are done."""
        self._after_compute(self.h2d_stream)
        for event in _distinct(after.event for _, _, after in items):
            self.h2d_stream.wait_event(event)
        with torch.cuda.stream(self.h2d_stream):
            for slot, dst, _ in items:
                dst.copy_(slot, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.h2d_stream)
        return [Copy("h2d", dst.numel(), event=done, after=after) for _, dst, after in items]

    def wait(self, copy: Copy) -> None:
        self.wait_many([copy])

    def wait_many(self, copies: list[Copy]) -> None:
        compute = self._compute()
        for event in _distinct(copy.event for copy in copies):
            compute.wait_event(event)

    def evict(self, held: torch.Tensor) -> None:
        self._compute()
        _resize(held, 0)  # the compute stream has waited for its D2H: the block is free for it

    def restore(self, held: torch.Tensor, nbytes: int) -> None:
        self._compute()
        _resize(held, nbytes)  # allocated on the compute stream, as a prefetch buffer is

    def released(self, src: torch.Tensor) -> None:
        pass

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def _distinct(events: Any) -> list[Any]:
    """The events, each once (a batch's copies share one), ``None`` left out."""
    seen: dict[int, Any] = {}
    for event in events:
        if event is not None:
            seen.setdefault(id(event), event)
    return list(seen.values())


def _resize(held: torch.Tensor, nbytes: int) -> None:
    """Resize the storage behind ``held`` in place: every tensor of it, the model's own, sees the change."""
    torch.ops.inductor.resize_storage_bytes_(held, nbytes)


BACKENDS = names.table(names.BACKENDS, {"cuda": CudaBackend, "cpu-eager": CpuEagerBackend, "cpu-lazy": CpuLazyBackend},
                       "copy backends")


def default_backend(device: torch.device) -> str:
    """CUDA streams on a GPU, eager copies on the CPU."""
    return "cuda" if device.type == "cuda" else "cpu-eager"


def make_backend(name: str | None, device: torch.device) -> CpuEagerBackend | CudaBackend:
    """The backend ``name`` on ``device`` (``None``: ``default_backend``)."""
    name = name or default_backend(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name](device)
