"""Resources a training step ran out of: the budget, GPU memory, host memory.

All three exit with code 6 (the solver's codes are 2-5, differing gradients 7), and all
three still leave the run report behind: the steps measured before the failure are what
tells the user how far off the chain was.
"""
from __future__ import annotations

from solver.errors import OffloadError


class ResourceExhausted(OffloadError):
    exit_code = 6


class BudgetExceeded(ResourceExhausted):
    """A measured step went over the schedule's budget."""


class OutOfMemory(ResourceExhausted):
    """The allocator refused a block during a step with offloading."""


class HostMemoryShortfall(ResourceExhausted):
    """The pinned host arena does not fit in the host's available memory."""
