"""Argument types for the command line: every number is checked when it is parsed.

argparse calls a type with the flag's text and turns a ``ValueError`` or
``ArgumentTypeError`` into ``offload CMD: error: argument --flag: <message>`` and exit
status 2, so each flag gets one clear line naming it and its range, never a traceback or
a value that silently means something else (``--time-limit nan`` ran with no limit).
"""
from __future__ import annotations

import argparse
import math
from typing import Callable

MAX_SECONDS = 1e6  # about 11.6 days: the longest time any flag accepts


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def number(minimum: float = 0.0, maximum: float = MAX_SECONDS, strict: bool = True,
           what: str = "a number") -> Callable[[str], float]:
    """A finite number above ``minimum`` (or at least it, not ``strict``) and at most ``maximum``."""
    def parse(text: str) -> float:
        value = _number(text)
        low = value <= minimum if strict else value < minimum
        if low or value > maximum:
            side = ">" if strict else ">="
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {what} {side} {minimum:g} and "
                                             f"<= {maximum:g}")
        return value
    return parse


def seconds(minimum: float = 0.0, strict: bool = True) -> Callable[[str], float]:
    """A duration in seconds, finite, above ``minimum`` (or at least it), at most ``MAX_SECONDS``."""
    return number(minimum, MAX_SECONDS, strict, "seconds")


def fraction(text: str) -> float:
    """A number in [0, 1] (a relative gap)."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is out of range: give a number from 0 to 1 (1e-4 is 0.01%)")
    return value


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number in ``[minimum, maximum]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum or (maximum is not None and value > maximum):
            top = f" and <= {maximum}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a whole number >= {minimum}{top}")
        return value
    return parse
