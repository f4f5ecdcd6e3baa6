"""Reading JSON with clear errors, and writing files atomically.

Outputs are written to a temporary file in the destination folder and renamed into place,
so an interrupted or failed command never leaves a partial or corrupt file behind.
"""
from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from .errors import FormatError


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Parse ``path`` as JSON; ``what`` names the file's role in error messages."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError(f"{what} file not found: {p}", "check the path") from None
    except OSError as exc:
        raise FormatError(f"cannot read {what} file {p}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError(
            f"{what} file {p} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            f"fix the file or produce it again with the tool",
        ) from None


def write_atomic(path: str | os.PathLike, write: Callable[[Any], None], binary: bool = False) -> None:
    """Call ``write(fileobj)`` on a temp file next to ``path``, then rename it into place."""
    dest = Path(path)
    folder = dest.parent if str(dest.parent) else Path(".")
    if not folder.is_dir():
        raise FormatError(f"output folder does not exist: {folder}", "create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
            write(fh)
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically."""
    write_atomic(path, lambda fh: (json.dump(data, fh, indent=2), fh.write("\n")))


def write_csv(path: str | os.PathLike, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    """Write ``rows`` as CSV with a header (``columns``, default the first row's keys), atomically;
    ``None`` becomes an empty cell."""
    def write(fh: Any) -> None:
        w = csv.DictWriter(fh, columns or list(rows[0]))
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    write_atomic(path, write)
