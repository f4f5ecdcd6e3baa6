"""Entry point of the ``offload`` console command.

Each package adds its own subcommands; this module only assembles them, maps
``OffloadError`` to one clear message and a non-zero exit code, and never shows a
traceback for bad input.  Every ``cli`` module builds its parser without importing torch
or matplotlib (its commands import them when they run), so ``offload solve`` starts fast.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import sys
import warnings
from typing import Callable

from offload.analysis import cli as analysis_cli
from offload.errors import OffloadError, Stopped
from offload.executor import cli as executor_cli
from offload.io import files
from offload.io.text import report_error
from offload.profiler import cli as profiler_cli
from offload.solver import cli as solver_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offload",
        description="Train a PyTorch model that does not fit in GPU memory by moving activations to CPU memory "
                    "and back, on a provably optimal (or near-optimal) schedule.",
        epilog="Run `offload COMMAND --help` for each command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    profiler_cli.add_commands(sub)
    solver_cli.add_commands(sub, verified=profiler_cli.solve_verified)
    executor_cli.add_commands(sub)
    analysis_cli.add_commands(sub)
    return parser


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM stops a command as Ctrl-C does: its workers, ranks and solver threads too."""
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = signal.signal(signal.SIGTERM, _stop)
    formatted = warnings.formatwarning
    warnings.formatwarning = functools.partial(_warning, formatted)
    try:
        return _command(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)
        warnings.formatwarning = formatted


_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warning(libraries: Callable[..., str], message: Warning | str, category: type[Warning], filename: str,
             lineno: int, line: str | None = None) -> str:
    """Our own warnings as the command's other warnings read, one line ``warning: ...``, not
    with the file, line and source line Python shows (where our code raised it, which tells a
    user nothing); the libraries' in ``libraries``' form (Python's)."""
    if os.path.abspath(filename).startswith(_OURS):
        return f"warning: {message}\n"
    return libraries(message, category, filename, lineno, line)


SIGNED = ("--budget", "-b", "--budgets")  # flags whose value a user may write with a minus


def _with_signed_values(argv: list[str]) -> list[str]:
    """``--budget -1GiB`` as ``--budget=-1GiB``: argparse takes a value starting with a minus for
    another flag (and says "expected one argument"); joined, the value's own check speaks."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in SIGNED and re.match(r"-[0-9.]", arg):
            flag = out.pop()
            out.append(f"{flag}={arg}" if flag.startswith("--") else flag + arg)
        else:
            out.append(arg)
    return out


def _command(argv: list[str]) -> int:
    argv = _with_signed_values(argv)
    with files.command() as command:  # the files this command reads and writes (offload.io.files)
        try:
            args = build_parser().parse_args(argv)
        except OffloadError as exc:  # from an argument's type: an output that cannot be written
            return report_error(next((a for a in argv if not a.startswith("-")), "?"), exc)
        args.argv = argv  # to start the command again (train --nproc)
        try:
            command.check()  # every output against every input named, before any work
            return args.func(args)
        except OffloadError as exc:
            return report_error(args.command, exc)
        except BrokenPipeError:  # output piped into `head` and closed: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except KeyboardInterrupt as exc:
            stop = Stopped.of(exc)
            print(f"offload {args.command}: {'interrupted' if stop.signum == signal.SIGINT else 'stopped'} "
                  f"({signal.Signals(stop.signum).name}); {stop.note}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(128 + stop.signum)  # now: a cancelled MILP solver thread may still be finishing its presolve


if __name__ == "__main__":
    sys.exit(main())
