"""The host arena: pinned memory planned from the schedule, reused across steps.

Per-tensor pinned allocation in the training loop costs milliseconds each and kills
overlap (docs/executor.md, "Pitfalls"), so the arena is one buffer sized from the
schedule (the bytes of all offloaded units, plus alignment), allocated before the first
step, and checked against the host memory available to this process (its cgroup's limit
included) times the ranks on the machine; a pinned chunk is counted at the power of two
CUDA's host allocator really takes.  Slots are handed out in the order the runtime asks for them (unit, then storage in
save order), which is the same at every step, so step 2 reuses step 1's offsets.  If a
step needs more than planned (a storage the chain did not count) the arena grows once, in
step 1, and says so (``grown``); it never allocates after that.  Each slot remembers the
last copy that read it (its H2D), which the next D2H into it must wait for.
"""
from __future__ import annotations

import torch

from offload.core.devices import available_host_bytes
from offload.core.meters import host_allocation
from offload.errors import HostMemoryShortfall, first_line
from offload.io.text import format_bytes

from .backends import Copy
from .distributed import ranks_on_this_machine

ALIGN = 512


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def footprint(nbytes: int, pin: bool) -> int:
    """The host memory a chunk really takes: CUDA's caching host allocator rounds a pinned
    allocation up to a power of two, so the arena uses (and counts) all of it."""
    return 1 << (nbytes - 1).bit_length() if pin and nbytes > 0 else nbytes


_SHORTFALL_HINT = ("the arena holds every offloaded unit at once: free host memory, or solve with a larger budget "
                   "so that fewer bytes are offloaded")


class HostArena:
    def __init__(self, planned_bytes: int, pin: bool) -> None:
        self.pin = pin
        self.chunks: list[torch.Tensor] = []
        self.allocations = 0  # host buffers allocated so far (the test: none after step 1)
        self.grown = 0  # bytes added beyond the plan
        self._layout: list[tuple[int, int, int]] = []  # slot index -> (chunk, offset, nbytes)
        self._guards: list[Copy | None] = []
        self._next = 0
        self._fill = 0
        if planned_bytes:  # slack for per-storage alignment, which the chain's byte counts do not include
            self._add_chunk(planned_bytes + planned_bytes // 50 + 128 * ALIGN)

    def _add_chunk(self, nbytes: int) -> None:
        nbytes = footprint(_round(nbytes), self.pin)
        kind = "pinned host memory" if self.pin else "host memory"
        available, ranks = available_host_bytes(), ranks_on_this_machine()
        if available is not None and nbytes * ranks > available:
            each = f" for each of the {ranks} ranks on this machine" if ranks > 1 else ""
            raise HostMemoryShortfall(f"the host arena needs {format_bytes(nbytes)} of {kind}{each}, but only "
                                      f"{format_bytes(available)} is available", _SHORTFALL_HINT)
        try:
            with host_allocation():
                chunk = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as exc:  # cudaHostAlloc refuses, or the host allocator does
            raise HostMemoryShortfall(f"could not allocate {format_bytes(nbytes)} of {kind} for the host arena "
                                      f"({first_line(exc)})", _SHORTFALL_HINT) from None
        self.chunks.append(chunk)
        self.allocations += 1
        self._fill = 0

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def start_step(self) -> None:
        self._next = 0

    def slot(self, nbytes: int, spare: int = 0) -> tuple[int, torch.Tensor]:
        """The next slot of the step (same offsets every step), with room for ``nbytes``, and
        ``spare`` more when it is first placed (for blobs whose size varies between steps)."""
        i = self._next
        self._next += 1
        if i < len(self._layout) and self._layout[i][2] >= nbytes:
            c, off, _ = self._layout[i]
            return i, self.chunks[c][off:off + nbytes]
        # a new slot, or a larger one: a sparse blob grows when its storage has fewer zeros
        # than in earlier steps (counted in ``allocations`` when it takes a new chunk)
        need = _round(nbytes + spare)
        if not self.chunks or self._fill + need > self.chunks[-1].numel():
            self.grown += need
            self._add_chunk(max(need, 64 * 2**20))
        c, off = len(self.chunks) - 1, self._fill
        self._fill += need
        if i < len(self._layout):  # the old place is abandoned: the new one has no reader yet
            self._layout[i], self._guards[i] = (c, off, need), None
        else:
            self._layout.append((c, off, need))
            self._guards.append(None)
        return i, self.chunks[c][off:off + nbytes]

    def guard(self, i: int) -> Copy | None:
        return self._guards[i]

    def set_guard(self, i: int, copy: Copy) -> None:
        self._guards[i] = copy
