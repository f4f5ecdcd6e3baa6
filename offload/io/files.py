"""Reading JSON with clear errors, and writing every output by one rule.

Reading: a missing or unreadable file, invalid JSON and JSON nested past any format's
depth are each one ``FormatError`` naming the file.

Writing (every command's ``-o``, ``--report``, ``--graphml``, ...): the target must be a
regular file or not exist yet, in a folder that exists, and must not be one of the
command's own inputs; a symbolic link is written through to its target.  The data goes
to a temporary file in the target's folder, is flushed to disk (``fsync``) and renamed
into place, so an interrupted, failed or full-disk command never leaves a partial or
corrupt file, nor its temporary file.  The new file gets the mode a new file gets from
the umask (or the mode of the file it replaces).  Every failure is one ``FormatError``.
"""
from __future__ import annotations

import csv
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from ..errors import FormatError

T = TypeVar("T")

MAX_JSON_DEPTH = 64


def _depth_ok(text: str) -> bool:
    """Whether no bracket nests deeper than ``MAX_JSON_DEPTH`` (checked before parsing: a deep
    document makes Python's parser recurse until it fails)."""
    depth, quoted, escaped = 0, False, False
    for ch in text:
        if quoted:
            escaped, quoted = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Parse ``path`` as JSON; ``what`` names the file's role in error messages."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError(f"{what} file not found: {p}", "check the path") from None
    except IsADirectoryError:
        raise FormatError(f"{what} file {p} is a folder", "give the path of a file") from None
    except UnicodeDecodeError:
        raise FormatError(f"{what} file {p} is not UTF-8 text", f"give a {what} JSON file") from None
    except OSError as exc:
        raise FormatError(f"cannot read {what} file {p}: {exc.strerror}") from None
    if not _depth_ok(text):
        raise FormatError(f"{what} file {p} nests brackets deeper than {MAX_JSON_DEPTH} levels", f"give a {what} JSON file")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{what} file {p} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
                          "fix the file or produce it again with the tool") from None


def read_document(path: str | os.PathLike, what: str, parse: Callable[[Any], T]) -> T:
    """``parse`` of the JSON in ``path``; a format error names the file (once)."""
    try:
        return parse(read_json(path, what))
    except FormatError as exc:
        if str(path) in str(exc):
            raise
        raise FormatError(f"{path}: {exc}", exc.hint) from None


def check_output(path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """The real path an output will be written to, or a ``FormatError`` saying why it cannot."""
    dest = Path(os.path.realpath(path))
    if dest.exists():
        mode = dest.stat().st_mode
        if stat.S_ISDIR(mode):
            raise FormatError(f"output {path} is a folder", "give a file name, e.g. folder/out.json")
        if not stat.S_ISREG(mode):
            raise FormatError(f"output {path} is not a regular file (a device, pipe or socket)",
                              "give the path of a file to write")
        for other in inputs:
            if os.path.exists(other) and os.path.samefile(dest, other):
                raise FormatError(f"output {path} is also an input of this command", "write to another file")
    if not dest.parent.is_dir():
        raise FormatError(f"output folder does not exist: {dest.parent}", "create it first")
    return dest


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: str | os.PathLike, write: Callable[[Any], None], binary: bool = False,
                 inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Call ``write(fileobj)`` on a temp file next to ``path``'s target, then rename it into place."""
    dest = check_output(path, inputs)
    mode = stat.S_IMODE(dest.stat().st_mode) if dest.exists() else _umask_mode()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as exc:
        raise FormatError(f"cannot write {path}: {exc.strerror}", "check the folder's permissions") from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise FormatError(f"cannot write {path}: {exc.strerror or exc}",
                              "free disk space or check the folder's permissions; nothing was written") from None
        raise


def write_json(path: str | os.PathLike, data: Any, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Write ``data`` as indented JSON, atomically."""
    write_atomic(path, lambda fh: (json.dump(data, fh, indent=2), fh.write("\n")), inputs=inputs)


def write_csv(path: str | os.PathLike, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    """Write ``rows`` as CSV with a header (``columns``, default the first row's keys), atomically;
    ``None`` becomes an empty cell."""
    def write(fh: Any) -> None:
        w = csv.DictWriter(fh, columns or list(rows[0]))
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    write_atomic(path, write)
