"""Reading inputs and writing outputs, by one rule for every command (docs/cli.md, "Guarantees").

Reading (chains, schedules, sweep CSVs, model files): only a regular file is read (a pipe,
a device or a socket, or a link to one, is refused, never waited on), and at most
``MAX_INPUT_BYTES`` of it; a missing or unreadable file, text that is not UTF-8, invalid
JSON, JSON nested past any format's depth, a key given twice and a number too long for
Python are each one ``FormatError`` naming the file.

Writing (every command's ``-o``, ``--report``, ``--graphml``, ...): the target must be a
regular file or not exist yet, in a folder that exists; a symbolic link is written through
to its target.  The data goes to a temporary file in the target's folder, is flushed to
disk (``fsync``) and renamed into place, so an interrupted, failed or full-disk command
never leaves a partial or corrupt file, nor its temporary file.  The new file gets the mode
a new file gets from the umask (or the mode of the file it replaces).

Within one command of the command line (``command()``, opened by ``offload.cli``) the
files are tracked: every file read is an *input*, every output path named on the command
line is declared when parsed (``output_path``), and an output may be neither an input nor
another output of the same command.  Declared outputs are checked before any work starts;
the writer checks again against everything read and written since, so a command cannot
forget the rule.  Every failure is one ``FormatError``.
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from offload.errors import FormatError

T = TypeVar("T")

MAX_JSON_DEPTH = 64
MAX_INPUT_BYTES = 1 << 30  # far above any chain (a 10,000-stage one is ~10 MB), schedule or sweep


class Command:
    """The files of one command: what it read, the outputs named on its command line, and
    what it wrote."""

    def __init__(self) -> None:
        self.inputs: dict[str, str] = {}  # real path -> as the user wrote it
        self.declared: dict[str, str] = {}
        self.written: dict[str, str] = {}

    def read(self, path: str | os.PathLike) -> None:
        self.inputs.setdefault(os.path.realpath(path), str(path))

    def _not_an_input(self, real: str, path: str | os.PathLike) -> None:
        if real in self.inputs:
            raise FormatError(f"output {path} is also an input of this command ({self.inputs[real]})",
                              "write to another file: the input would be lost")

    def declare(self, path: str | os.PathLike) -> None:
        """An output named on the command line: refused if it is an input or another output."""
        self._add(self.declared, path, "is also another output of this command")

    def write(self, path: str | os.PathLike) -> None:
        """About to write ``path``: refused if it was read, or written already, by this command."""
        self._add(self.written, path, "was written already by this command")

    def _add(self, outputs: dict[str, str], path: str | os.PathLike, twice: str) -> None:
        real = os.path.realpath(path)
        self._not_an_input(real, path)
        if real in outputs:
            raise FormatError(f"output {path} {twice} ({outputs[real]})", "give each output its own file")
        outputs[real] = str(path)

    def check(self) -> None:
        """Every declared output against every input known now (all of them, once parsed)."""
        for real, path in self.declared.items():
            self._not_an_input(real, path)


_current: Command | None = None


@contextlib.contextmanager
def command() -> Iterator[Command]:
    """Track the files of one command (module docstring); outside it, nothing is tracked."""
    global _current
    previous, _current = _current, Command()
    try:
        yield _current
    finally:
        _current = previous


def input_path(text: str) -> str:
    """Argument type of a file the command reads: remembered as an input of the command."""
    if not text:
        raise FormatError("an input path is empty", "give the path of a file")
    if _current is not None:
        _current.read(text)
    return text


def model_input(text: str) -> str:
    """Argument type of a MODEL: when it names a Python file (``path/file.py:fn``), that file is an
    input of the command.  A JSON file is refused as no model: it is a chain or a schedule given
    where ``train`` takes its optional MODEL (``offload train chain.json schedule.json``)."""
    if text.lower().endswith(".json"):
        raise FormatError(f"MODEL {text!r} is a JSON file, not a model (a zoo name, torchvision:NAME, file.py:fn or "
                          "package.module:fn)", "a chain or a schedule is given as such: offload train --chain "
                          f"{text} --schedule SCHEDULE.json (the model is the one the chain names), offload show {text}")
    target = text.rpartition(":")[0]
    if target.endswith(".py") or "/" in target or "\\" in target:
        input_path(target)
    return text


def output_path(text: str) -> str:
    """Argument type of a file the command writes: checked as ``check_output`` does and declared,
    before any work."""
    if not text:
        raise FormatError("an output path is empty", "give the path of a file to write, e.g. -o out.json")
    check_output(text)
    if _current is not None:
        _current.declare(text)
    return text


def regular_file(path: str | os.PathLike, what: str, limit: int | None = None) -> Path:
    """``path`` checked readable as a ``what``: it exists, is a regular file (or a link to one),
    at most ``limit`` bytes (default ``MAX_INPUT_BYTES``); remembered as an input of the command."""
    p = Path(path)
    limit = MAX_INPUT_BYTES if limit is None else limit
    try:
        st = p.stat()
    except FileNotFoundError:
        raise FormatError(f"{what} file not found: {p}", "check the path") from None
    except OSError as exc:
        raise FormatError(f"cannot read {what} file {p}: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise FormatError(f"{what} file {p} is a folder", "give the path of a file")
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{what} file {p} is not a regular file (a device, pipe or socket)",
                          f"give the path of a {what} file")
    if st.st_size > limit:
        raise FormatError(f"{what} file {p} is {st.st_size} bytes, more than any {what} ({limit})",
                          f"give a {what} file made by the tool")
    if _current is not None:
        _current.read(p)
    return p


def read_text(path: str | os.PathLike, what: str, limit: int | None = None) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes (``regular_file``)."""
    limit = MAX_INPUT_BYTES if limit is None else limit
    p = regular_file(path, what, limit)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)  # a file swapped for a pipe since the check never blocks
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise FormatError(f"{what} file {p} is not a regular file", f"give the path of a {what} file")
            data = fh.read(limit + 1)
    except OSError as exc:
        raise FormatError(f"cannot read {what} file {p}: {exc.strerror}") from None
    if len(data) > limit:
        raise FormatError(f"{what} file {p} is more than {limit} bytes", f"give a {what} file made by the tool")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{what} file {p} is not UTF-8 text", f"give a {what} JSON file") from None


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


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice in one object")
        out[key] = value
    return out


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Parse ``path`` as JSON; ``what`` names the file's role in error messages."""
    p = Path(path)
    text = read_text(p, what)
    if not _depth_ok(text):
        raise FormatError(f"{what} file {p} nests brackets deeper than {MAX_JSON_DEPTH} levels", f"give a {what} JSON file")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{what} file {p} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
                          "fix the file or produce it again with the tool") from None
    except ValueError as exc:  # a key twice, or an integer past Python's 4,300 digits
        problem = "holds a number of more than 4,300 digits" if "digits" in str(exc) else f"is not valid: {exc}"
        raise FormatError(f"{what} file {p} {problem}", "fix the file or produce it again with the tool") from None


def read_document(path: str | os.PathLike, what: str, parse: Callable[[Any], T]) -> T:
    """``parse`` of the JSON in ``path``; a format error names the file (once)."""
    try:
        return parse(read_json(path, what))
    except FormatError as exc:
        if str(path) in str(exc):
            raise
        raise FormatError(f"{path}: {exc}", exc.hint) from None


def check_output(path: str | os.PathLike) -> Path:
    """The real path an output will be written to, or a ``FormatError`` saying why it cannot."""
    dest = Path(os.path.realpath(path))
    if dest.exists():
        mode = dest.stat().st_mode
        if stat.S_ISDIR(mode):
            raise FormatError(f"output {path} is a folder", "give a file name, e.g. folder/out.json")
        if not stat.S_ISREG(mode):
            raise FormatError(f"output {path} is not a regular file (a device, pipe or socket)",
                              "give the path of a file to write")
    if not dest.parent.is_dir():
        raise FormatError(f"output folder does not exist: {dest.parent}", "create it first")
    return dest


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: str | os.PathLike, write: Callable[[Any], None], binary: bool = False) -> None:
    """Call ``write(fileobj)`` on a temp file next to ``path``'s target, then rename it into place
    (in a command: refused if the command read it, or wrote it already)."""
    dest = check_output(path)
    if _current is not None:
        _current.write(path)
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
