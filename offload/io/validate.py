"""Reading the fields of a parsed JSON document: one rule for every format.

Each reader names the field in its error (``stages[3].fwd_s``) and holds it to a documented
range, so that no value is half-used or silently means something else:

* bytes: whole numbers in ``[0, 2**53]`` (exact in a float, far above any memory);
* seconds: finite, in ``[0, 1e6]``;
* bandwidths: finite, in ``[1, 1e15]`` bytes per second;
* no field the format does not define; strings are printed sanitized (``text.printable``).
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterator, Mapping, Sequence

from ..errors import FormatError
from .argtypes import MAX_SECONDS

MAX_BYTES = 2 ** 53
BANDWIDTH = (1.0, 1e15)


def where(ctx: str, key: str) -> str:
    return f"{ctx}.{key}" if ctx else key


def _present(d: Mapping, key: str, ctx: str) -> Any:
    if key not in d:
        raise FormatError(f"missing field '{where(ctx, key)}'")
    return d[key]


def document_format(d: Any, what: str, current: str, old: Sequence[str], hint: str) -> str:
    """The ``format`` of a parsed document that must be a JSON object of format ``current``
    (or one of the ``old`` ones it still reads): a ``what`` file, made as ``hint`` says."""
    if not isinstance(d, Mapping):
        raise FormatError(f"a {what} must be a JSON object, got {type(d).__name__}")
    fmt = d.get("format")
    if fmt != current and fmt not in old:
        raise FormatError(f"not a {what} file: 'format' is {fmt!r}, expected {current!r}", hint)
    return fmt


def number(d: Mapping, key: str, ctx: str, low: float = 0.0, high: float = MAX_SECONDS) -> float:
    """A finite number in ``[low, high]``."""
    v = _present(d, key, ctx)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise FormatError(f"'{where(ctx, key)}' must be a finite number, got {v!r}")
    if not low <= v <= high:
        raise FormatError(f"'{where(ctx, key)}' must be in [{low:g}, {high:g}], got {v!r}")
    return float(v)


def seconds(d: Mapping, key: str, ctx: str) -> float:
    return number(d, key, ctx, 0.0, MAX_SECONDS)


def bandwidth(d: Mapping, key: str, ctx: str) -> float:
    return number(d, key, ctx, *BANDWIDTH)


def whole(d: Mapping, key: str, ctx: str, low: int = 0, high: int = MAX_BYTES) -> int:
    """An integer in ``[low, high]`` (a float with an integral value is accepted)."""
    v = _present(d, key, ctx)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
        raise FormatError(f"'{where(ctx, key)}' must be a whole number, got {v!r}")
    if not low <= v <= high:
        raise FormatError(f"'{where(ctx, key)}' must be in [{low}, {high}], got {v!r}")
    return int(v)


def nbytes(d: Mapping, key: str, ctx: str) -> int:
    """A whole number of bytes in ``[0, 2**53]``."""
    return whole(d, key, ctx, 0, MAX_BYTES)


def string(d: Mapping, key: str, ctx: str, default: str | None = None) -> str:
    if key not in d and default is not None:
        return default
    v = _present(d, key, ctx)
    if not isinstance(v, str) or not v:
        raise FormatError(f"'{where(ctx, key)}' must be a non-empty string, got {v!r}")
    return v


def choice(d: Mapping, key: str, ctx: str, choices: Sequence[str], default: str | None = None) -> str | None:
    """One of ``choices``; ``default`` when absent (a ``None`` default: the field may be absent or null)."""
    value = d.get(key, default)
    if value is None and default is None:
        return None
    if value not in choices:
        absent = " or absent" if default is None else ""
        raise FormatError(f"'{where(ctx, key)}' must be one of {', '.join(choices)}{absent}, got {value!r}")
    return value


def matching(d: Mapping, key: str, ctx: str, pattern: re.Pattern, what: str) -> tuple[str, ...]:
    """A list (default empty) of strings that each match ``pattern``, described as ``what``."""
    value = d.get(key, [])
    if not isinstance(value, list) or not all(isinstance(x, str) and pattern.fullmatch(x) for x in value):
        raise FormatError(f"'{where(ctx, key)}' must be a list of {what}")
    return tuple(value)


def flag(d: Mapping, key: str, ctx: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise FormatError(f"'{where(ctx, key)}' must be true or false, got {v!r}")
    return v


def obj(v: Any, ctx: str) -> Mapping:
    if not isinstance(v, Mapping):
        raise FormatError(f"'{ctx}' must be an object, got {'nothing' if v is None else type(v).__name__}")
    return v


def no_unknown(d: Mapping, allowed: set[str], ctx: str) -> None:
    unknown = sorted(map(str, set(d) - allowed))
    if unknown:
        raise FormatError(f"unknown field(s) {', '.join(repr(k) for k in unknown)} in {ctx}",
                          f"allowed fields: {', '.join(sorted(allowed))}")


def objects(raw: Any, ctx: str, allowed: set[str]) -> Iterator[tuple[str, Mapping]]:
    """Each item of a list of objects with its context, refused unless it is an object with
    only ``allowed`` fields."""
    if not isinstance(raw, list):
        raise FormatError(f"'{ctx}' must be a list")
    for n, item in enumerate(raw):
        at = f"{ctx}[{n}]"
        if not isinstance(item, Mapping):
            raise FormatError(f"{at} must be an object")
        no_unknown(item, allowed, at)
        yield at, item
