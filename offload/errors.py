"""Errors a user can act on, for every part of the tool.

Every error the tool raises on bad input or an exhausted resource is an ``OffloadError``:
one message naming the problem, and a ``hint`` saying what to do about it.  The CLI prints
both and exits with the class's code; nothing else is ever shown to the user as a
traceback.  Codes: 2 bad input (a file, a model, a chain that does not match), 3 a
schedule the simulator refuses, 4 a budget that cannot be met, 5 a solver failure, 6 a
training step out of its budget or of GPU or host memory (the run report is still
written), 7 gradients that differ from training without offloading; 128 + the signal's
number when stopped by Ctrl-C (130) or SIGTERM (143).
"""
from __future__ import annotations

import signal


class Stopped(KeyboardInterrupt):
    """A command stopped by a signal: Ctrl-C (SIGINT) or SIGTERM.  Every ``except
    KeyboardInterrupt`` that stops work on Ctrl-C stops it on SIGTERM too; the command line
    says ``note`` and exits with 128 + the signal's number."""

    def __init__(self, signum: int, note: str = "no output written") -> None:
        super().__init__(note)
        self.signum, self.note = signum, note

    @classmethod
    def of(cls, exc: KeyboardInterrupt, note: str | None = None) -> "Stopped":
        """``exc`` as a ``Stopped`` (a bare ``KeyboardInterrupt`` is Ctrl-C's), with ``note`` if given."""
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        return cls(signum, note or (exc.note if isinstance(exc, Stopped) else "no output written"))


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of another library's error, cut to ``limit`` characters: what a
    message of ours quotes of it (its traceback is not shown)."""
    return str(exc).splitlines()[0][:limit] if str(exc) else ""


class OffloadError(Exception):
    """Base class: ``str(err)`` is the problem, ``err.hint`` what to do."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


def offload_cause(exc: BaseException) -> OffloadError | None:
    """The ``OffloadError`` ``exc`` is or wraps (a compiler hands the error our partitioner
    raised back as its own, the ours as its cause), if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OffloadError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    return None


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


class ModelError(OffloadError):
    """The MODEL string is unknown, or building or running the model failed."""

    exit_code = 2


class CallsDiffer(ModelError, RuntimeError):
    """A forward whose module calls are not the profiled ones (stage boundaries out of order or
    missing): the model's control flow depends on random draws or on the input's values.  A
    ``RuntimeError`` too: it is raised inside the model's forward, from a hook."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "a schedule follows one sequence of module calls, the profiled one: a model that "
                                  "skips blocks at random while training (stochastic depth that skips whole blocks, "
                                  "LayerDrop) or calls them by the input's values cannot follow it; make its calls "
                                  "the same at every step (turn the skipping off for training with offload)")


class ResourceExhausted(OffloadError):
    """A training step ran out of something; the steps before it are in the report."""

    exit_code = 6


class BudgetExceeded(ResourceExhausted):
    """A measured step went over the schedule's budget."""


class OutOfMemory(ResourceExhausted):
    """The allocator refused a block during a step with offloading."""


class HostMemoryShortfall(ResourceExhausted):
    """The pinned host arena does not fit in the host's available memory."""
