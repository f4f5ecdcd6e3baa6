"""The schedule's copies as ops of a compiled graph, run by ``Offloaded``'s own backends and arena.

``compile_scheduled`` puts four ops into the forward and backward graphs AOTAutograd made
of the user's module (``offload.executor.compiled_copies`` says where); each names a
``GraphCopies`` (the copies of one compiled module, by number) and a *key*, the moved
value's place in the forward's order:

* ``offload::d2h(values, layout, length, copies, key) -> host``: the D2H copy of the values
  saved in one storage into the key's slot of the host arena, ``length`` elements laid out
  as ``layout`` says (per value: its size, stride and offset, the graph's), issued on the
  backend (CUDA: the D2H stream, after the compute stream as it is now); ``host`` is the
  slot, flat.  Where the compiler laid the values out as the graph does (always, where it
  honours ``compiled_copies``' request to make them at the graph's strides), the copy is
  that extent of their storage; where it did not (Inductor gave some views of a Llama other
  strides than the graph's, which the backward's views of the fetched buffer would
  misread), the values are first put into the graph's layout in a device buffer, on the
  compute stream, and a warning says so (``GraphCopies.relaid``);
* ``offload::release(host, x, copies, key) -> host``: the compute stream waits for that
  copy and the runtime lets go of the copy's source (the graph frees ``x`` after its last
  use: this op is one, so no block is reused before the copy has read it; a later forward
  op of the model may still read ``x``, a U-Net's skip, so ``x`` is never poisoned here as
  the lazy backend poisons a released storage of ``Offloaded``); returns ``host`` (an
  alias), which the forward hands the backward instead of ``x``;
* ``offload::h2d(host, device, copies, key) -> buffer``: a fresh device buffer, allocated on
  the compute stream, filled from the slot on the backend (CUDA: the H2D stream, after the
  D2H), flat like ``host``;
* ``offload::wait(buffer, copies, key) -> buffer``: the compute stream waits for that H2D
  copy (an alias, so the views every reader reads come after it);
* ``offload::mark(copies, index)``: a stage boundary reached, handed to ``GraphCopies.marks``
  when the profiler listens (for a chain of the compiled graph: ``offload.profiler.compiled``),
  else nothing.  A run of such a chain has them where its profile had them: as the copies'
  ops do, each keeps Inductor from fusing work across its boundary (``after``), so the run's
  kernels are the profile's, copies or not;
* ``offload::ready(x, length) -> storage``: on such a chain, a saved storage that stays on the
  device handed to the backward where its wait would be, were it fetched
  (``compiled_copies.place_ready``): the whole storage of ``x`` from element 0 (``length``
  elements), an alias; the backward's kernels then read every unit as a fetched one, moved or
  not.  The op takes the storage's start itself: an ``as_strided`` of a graph input at an
  offset of its own was read by Inductor before torch 2.13 as relative to that offset.

Each takes ``after`` tensors it does not read: at a forward boundary the last value of the
stage it ends, at a backward one every value the graph before it hands on to later ops
(``compiled_copies.handed_on``), else the op before it.  Inductor's scheduler orders a
graph's nodes by their dependencies only: these keep it from moving the op earlier, and in
the backward from fusing an op before the boundary into a kernel after it (that kernel
would have to come after the op, and the op after it), which would move the op's work, and
what it holds, past the boundary.

The backends are ``Offloaded``'s (``offload.executor.backends``: CUDA streams and events, or
the CPU eager and lazy ones, the lazy one poisoning a buffer until its copy is waited for),
and so is the pinned ``HostArena``: one buffer planned from the moved values' bytes, its
slots handed out in key order, the same offsets every step, each D2H into a slot after its
last H2D.  No op reads anything back to the host.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Callable

import torch
from torch.fx import has_side_effect

from .arena import HostArena
from .backends import Copy, CpuEagerBackend, CudaBackend, make_backend

_LIB = torch.library.Library("offload", "DEF")
_LIB.define("d2h(Tensor[] values, int[] layout, int length, int copies, int key, Tensor[] after) -> Tensor")
_LIB.define("release(Tensor(a) host, Tensor x, int copies, int key, Tensor[] after) -> Tensor(a)")
_LIB.define("h2d(Tensor host, Device device, int copies, int key, Tensor[] after) -> Tensor")
_LIB.define("wait(Tensor(a) x, int copies, int key, Tensor[] after) -> Tensor(a)")
_LIB.define("mark(int copies, int index, Tensor[] after) -> ()")
_LIB.define("ready(Tensor(a) x, int length, Tensor[] after) -> Tensor(a)")

OPS = (torch.ops.offload.d2h.default, torch.ops.offload.release.default, torch.ops.offload.h2d.default,
       torch.ops.offload.wait.default)
D2H_OP, RELEASE_OP, H2D_OP, WAIT_OP = OPS
MARK_OP = torch.ops.offload.mark.default
READY_OP = torch.ops.offload.ready.default
ALL_OPS = (*OPS, MARK_OP, READY_OP)

_ALL: "weakref.WeakValueDictionary[int, GraphCopies]" = weakref.WeakValueDictionary()
_NUMBERS = itertools.count(1)


def _layouts(layout: list[int]) -> list[tuple[list[int], list[int], int]]:
    """``d2h``'s ``layout`` read back: per value, its size, stride and offset in the copy."""
    out, i = [], 0
    while i < len(layout):
        n = layout[i]
        out.append((layout[i + 1:i + 1 + n], layout[i + 1 + n:i + 1 + 2 * n], layout[i + 1 + 2 * n]))
        i += 2 + 2 * n
    return out


def _in_place(values: list[torch.Tensor], layouts: list[tuple[list[int], list[int], int]], length: int) -> int | None:
    """Where the copy starts in the values' own storage, when they are laid out there as the
    graph says (one storage, the graph's strides, the graph's distances apart): the copy is
    then that extent of it; ``None`` when the compiler laid them out otherwise."""
    storage = values[0].untyped_storage()
    start = values[0].storage_offset() - layouts[0][2]
    for v, (size, stride, offset) in zip(values, layouts):
        if (v.untyped_storage().data_ptr() != storage.data_ptr() or list(v.size()) != size
                or any(n > 1 and a != b for n, a, b in zip(size, v.stride(), stride))
                or v.storage_offset() - offset != start):
            return None
    return start if start >= 0 and (start + length) * values[0].element_size() <= storage.nbytes() else None


class GraphCopies:
    """The copies of one compiled module's graphs: its backend, its arena and the copies in flight.

    Its number, in the graphs' ops, is one of this process: made before the compile, so that
    a compile served from a cache (whose key holds the number) finds it.

    Args:
        backend: a name of ``offload.executor.backends.BACKENDS``, or ``None`` for the
            device's default; the backend is made at the first copy, on its tensor's device.
    """

    def __init__(self, backend: str | None) -> None:
        self.number = next(_NUMBERS)
        self.backend_name = backend
        self.planned_bytes = 0  # what the forward moves per step (the arena's plan), once placed
        self.device: torch.device | None = None  # the graph's, once placed: every copied value's
        self.backend: CpuEagerBackend | CudaBackend | None = None
        self.arena: HostArena | None = None
        self._out: dict[int, tuple[Copy, int, torch.Tensor]] = {}  # key -> (its D2H, slot index, slot)
        self._in: dict[int, Copy] = {}  # key -> its H2D
        self.steps = 0  # steps that moved something so far
        self.d2h_bytes = 0  # moved so far, each way
        self.h2d_bytes = 0
        self.relaid = 0  # copies whose values the compiler laid out otherwise than the graph (put back first)
        self.marks: Callable[[int], None] | None = None  # what reads the clock at the graph's stage boundaries
        _ALL[self.number] = self

    def _start(self, device: torch.device) -> None:
        self.backend = make_backend(self.backend_name, device)
        self.arena = HostArena(self.planned_bytes, self.backend.pin)

    def copy_out(self, values: list[torch.Tensor], layout: list[int], length: int, key: int) -> torch.Tensor:
        x = values[0]
        if x.device != self.device:  # the backend is the device's: a value elsewhere would go through the wrong one
            raise RuntimeError(f"offload::d2h: value {key} of the compiled graph is on {x.device}, where the graph's "
                               f"values it copies are on {self.device}: it should not have been placed")
        if self.backend is None:
            self._start(self.device)
        if key == 0:
            self.arena.start_step()
            self.steps += 1
        layouts = _layouts(layout)
        start = _in_place(values, layouts, length)
        if start is not None:  # the extent of their storage, as it is
            src = torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage(), start, (length,))
        else:  # laid out by the compiler otherwise: first into the graph's layout, on the compute stream
            src = self.backend.empty(length * x.element_size()).view(x.dtype)
            for v, (size, stride, offset) in zip(values, layouts):
                src.as_strided(size, stride, offset).copy_(v)
            self.relaid += 1
            if self.relaid == 1:
                warnings.warn(f"the compiler laid out a saved value of the compiled graph ({tuple(x.shape)}, "
                              f"{x.dtype}) otherwise than the graph: its copy puts it into the graph's layout first, "
                              "in a device buffer held until its release, which no chain counts (a budget may be "
                              "exceeded by such buffers), and the backward then reads the graph's layout, which may "
                              "round its gradients otherwise than plain torch.compile; GraphCopies.relaid counts them",
                              stacklevel=2)
        src = src.view(torch.uint8)
        index, slot = self.arena.slot(src.numel())
        copy = self.backend.d2h(src, slot, self.arena.guard(index))
        self._out[key] = (copy, index, slot)
        self.d2h_bytes += src.numel()
        return slot.view(x.dtype)

    def release(self, x: torch.Tensor, key: int) -> None:
        if key not in self._out:
            raise RuntimeError(f"offload::release: value {key} of the compiled graph has no D2H copy in flight")
        copy = self._out[key][0]
        self.backend.wait(copy)
        copy.keep.clear()

    def copy_in(self, host: torch.Tensor, key: int) -> torch.Tensor:
        if key not in self._out:
            raise RuntimeError(f"offload::h2d: value {key} of the compiled graph was not copied out in this step's "
                               "forward (a second backward through one forward?)")
        copy, index, slot = self._out.pop(key)
        buffer = self.backend.empty(slot.numel())
        back = self.backend.h2d(slot, buffer, copy)
        self.arena.set_guard(index, back)
        self._in[key] = back
        self.h2d_bytes += slot.numel()
        return buffer.view(host.dtype)

    def wait(self, key: int) -> None:
        copy = self._in.pop(key, None)
        if copy is None:
            raise RuntimeError(f"offload::wait: value {key} of the compiled graph has no H2D copy in flight")
        self.backend.wait(copy)


    def mark(self, index: int) -> None:
        if self.marks is not None:
            self.marks(index)


def copies(number: int) -> GraphCopies:
    return _ALL[number]


def _impl(name: str) -> Callable[[Callable], Callable]:
    return lambda fn: torch.library.impl(_LIB, name, "CompositeExplicitAutograd")(fn)


@_impl("d2h")
def _d2h(values: list[torch.Tensor], layout: list[int], length: int, number: int, key: int,
         after: list[torch.Tensor]) -> torch.Tensor:
    return copies(number).copy_out(values, layout, length, key)


@_impl("release")
def _release(host: torch.Tensor, x: torch.Tensor, number: int, key: int,
        after: list[torch.Tensor]) -> torch.Tensor:
    copies(number).release(x, key)
    return host


@_impl("h2d")
def _h2d(host: torch.Tensor, device: torch.device, number: int, key: int,
        after: list[torch.Tensor]) -> torch.Tensor:
    return copies(number).copy_in(host, key)


@_impl("wait")
def _wait(x: torch.Tensor, number: int, key: int,
        after: list[torch.Tensor]) -> torch.Tensor:
    copies(number).wait(key)
    return x


@_impl("mark")
def _mark(number: int, index: int, after: list[torch.Tensor]) -> None:
    copies(number).mark(index)


@_impl("ready")
def _ready(x: torch.Tensor, length: int, after: list[torch.Tensor]) -> torch.Tensor:
    return x.as_strided([length], [1], 0)


@torch.library.register_fake("offload::d2h", lib=_LIB)
def _d2h_fake(values: list[torch.Tensor], layout: list[int], length: int, number: int, key: int,
              after: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty(length, dtype=values[0].dtype, device="cpu")


@torch.library.register_fake("offload::release", lib=_LIB)
def _release_fake(host: torch.Tensor, x: torch.Tensor, number: int, key: int,
        after: list[torch.Tensor]) -> torch.Tensor:
    return host


@torch.library.register_fake("offload::h2d", lib=_LIB)
def _h2d_fake(host: torch.Tensor, device: torch.device, number: int, key: int,
        after: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty(host.size(), dtype=host.dtype, device=device)


@torch.library.register_fake("offload::wait", lib=_LIB)
def _wait_fake(x: torch.Tensor, number: int, key: int,
        after: list[torch.Tensor]) -> torch.Tensor:
    return x


@torch.library.register_fake("offload::mark", lib=_LIB)
def _mark_fake(number: int, index: int, after: list[torch.Tensor]) -> None:
    return None


@torch.library.register_fake("offload::ready", lib=_LIB)
def _ready_fake(x: torch.Tensor, length: int, after: list[torch.Tensor]) -> torch.Tensor:
    return x.as_strided([length], [1], 0)


for _op in ALL_OPS:
    has_side_effect(_op)
