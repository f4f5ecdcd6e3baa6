"""Text for people: bytes and time in human units both ways (``6GiB`` / ``800MB`` / ``60%`` in,
``1.5 GiB`` out), file contents made safe to print, the one line an error is shown as, and no
line that a C library prints on its own."""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from typing import Iterator

from ..errors import FormatError, OffloadError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


MAX_BUDGET_BYTES = 2 ** 53


def parse_budget(text: str, reference_bytes: int) -> int:
    """Bytes from ``123456``, ``6GiB``, ``800MB`` or ``60%`` (a share of ``reference_bytes``).

    A plain number is a whole number of bytes (``0.3`` is refused: a share is written
    ``30%``), and every budget is at most 2**53 bytes."""
    t = text.strip().replace("_", "")
    if t.startswith("-"):
        raise FormatError(f"budget {text!r} is negative", "a budget is bytes (4000000000), a size (6GiB) or a share (60%)")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(%|[a-zA-Z]*)", t)
    hint = "write bytes (4000000000), a size (6GiB, 800MB) or a share of the no-offload peak (60%)"
    if not m:
        raise FormatError(f"cannot read budget {text!r}", hint)
    value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value):
        raise FormatError(f"budget {text!r} is more than {MAX_BUDGET_BYTES} bytes (8 PiB)", hint)
    if unit == "%":
        nbytes = value / 100 * reference_bytes
    elif unit in _UNITS:
        if unit in ("", "b") and value != int(value):
            raise FormatError(f"budget {text!r} is a fraction of a byte", f"for a share of the peak write {value * 100:g}%")
        nbytes = value * _UNITS[unit]
    else:
        raise FormatError(f"unknown unit {m.group(2)!r} in budget {text!r}", "use one of B, KB, MB, GB, KiB, MiB, GiB or %")
    if not nbytes <= MAX_BUDGET_BYTES:  # also catches inf from 1e400
        raise FormatError(f"budget {text!r} is more than {MAX_BUDGET_BYTES} bytes (8 PiB)", hint)
    return int(nbytes)


def format_bytes(n: float) -> str:
    """``1.50 GiB``-style, binary units (what GPU memory is sold in)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def told_apart(a: int, b: int) -> tuple[str, str]:
    """``a`` and ``b`` as ``format_bytes`` writes them, each with its exact bytes where two
    different sizes would read the same (a budget of 1.46 MiB "below" a floor of 1.46 MiB)."""
    x, y = format_bytes(a), format_bytes(b)
    return (f"{x} ({int(a):,} B)", f"{y} ({int(b):,} B)") if x == y and a != b else (x, y)


def copies_off(moved: list[tuple[str, int, int]], slack: int = 0) -> str:
    """Where copies moved other bytes than the schedule books (``(way, moved, booked)`` each,
    beyond ``slack``), the sentence that says so and what it means for the predicted step;
    else ''.  The simulator times the copies by their booked bytes: a chain that books fewer
    than the executor moves predicts the step too short, a defect (a compiled Qwen2's
    offloaded checkpoints moved twice their booked bytes before the chain booked their dropout
    masks); more, and the prediction is an upper bound (a compiled copy moves the extent of
    its storage that the saved values span, which a chain of the compiled graph profiled
    before ``Stage.moved_bytes`` booked as the whole storage: a ViT's 5%)."""
    off = [f"{way} {format_bytes(done)} where it books {format_bytes(booked)}"
           for way, done, booked in moved if abs(done - booked) > slack]
    if not off:
        return ""
    if all(done <= booked for _, done, booked in moved):
        return (f"the copies moved less than the schedule books ({'; '.join(off)}): the predicted step's copy time "
                "is that much too long (an upper bound)")
    return (f"the copies moved more than the schedule books ({'; '.join(off)}): the predicted step's copy time is "
            "too short by as much; a defect of the chain (profile it again, or report it)")


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def parse_rate(text: str) -> float:
    """Bytes per second from ``25GB/s``, ``12.5 GiB/s`` or ``2.5e10``."""
    t = text.strip()
    body = t[:-2] if t.lower().endswith("/s") else t
    if body.strip().endswith("%"):
        raise FormatError(f"cannot read bandwidth {text!r}", "write it as 25GB/s, 12GiB/s or bytes per second")
    try:
        rate = float(parse_budget(body, 0))
    except FormatError:
        raise FormatError(f"cannot read bandwidth {text!r}", "write it as 25GB/s, 12GiB/s or bytes per second") from None
    if rate <= 0:
        raise FormatError(f"bandwidth must be positive, got {text!r}")
    return rate


_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_seconds(text: str) -> float:
    """Seconds from ``0.00001``, ``10us``, ``1.5ms``."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zµ]*)", text.strip().lower())
    if not m or m.group(2) not in _SECONDS:
        raise FormatError(f"cannot read duration {text!r}", "write seconds (0.00001) or with a unit (10us, 1.5ms)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """``text`` with control characters (terminal escape sequences among them) written as
    ``\\xNN``: what a file says is shown, never interpreted by the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def clipped(text: object, limit: int) -> str:
    """``printable(text)`` cut to ``limit`` characters, saying how many more there were (a file's
    free-text fields are shown, not dumped)."""
    shown = printable(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}… ({len(shown) - limit} more characters)"


def report_error(command: str, exc: OffloadError) -> int:
    """One error line (and its hint) on stderr for ``offload COMMAND``; the exit code that goes with it."""
    print(f"offload {command}: error: {printable(exc)}", file=sys.stderr)
    if exc.hint:
        print(f"  hint: {printable(exc.hint)}", file=sys.stderr)
    return exc.exit_code


@contextlib.contextmanager
def native_output_discarded(fd: int) -> Iterator[None]:
    """Point file descriptor ``fd`` (1 or 2) at /dev/null for the block: C libraries print there
    directly (a MILP solver's banner, ``torch.profiler``'s "USDT: ... profiler_start" lines),
    past ``sys.stdout`` and ``sys.stderr``, into the command's own output."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    saved, null = os.dup(fd), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(null)
