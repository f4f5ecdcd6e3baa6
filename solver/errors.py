"""Errors a user can act on.

Every error the tool raises on bad input is an ``OffloadError``: one message naming the
problem, and a ``hint`` saying what to do about it.  The CLI prints both and exits
non-zero; nothing else is ever shown to the user as a traceback.
"""
from __future__ import annotations


class OffloadError(Exception):
    """Base class: ``str(err)`` is the problem, ``err.hint`` what to do."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class FormatError(OffloadError):
    """A chain or schedule file is not valid JSON or breaks its format."""

    exit_code = 2


class ChainMismatch(OffloadError):
    """A schedule was made for another chain (its sha256 differs)."""

    exit_code = 2


class ScheduleRejected(OffloadError):
    """The simulator refuses a schedule: invalid action, or the budget is exceeded."""

    exit_code = 3


class InfeasibleBudget(OffloadError):
    """No schedule (or none of this method) fits the budget."""

    exit_code = 4

    def __init__(self, message: str, hint: str = "", smallest_bytes: int | None = None) -> None:
        super().__init__(message, hint)
        self.smallest_bytes = smallest_bytes


class SolverFailure(OffloadError):
    """A MILP/LP solver is unavailable or failed without producing a schedule."""

    exit_code = 5
