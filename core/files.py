"""Files under runs/ that other processes read while they change (--status, a resumed job, the report, an
eval job waiting on DONE): each is replaced whole or not at all, and survives a crash once written.

Every reader of the run folder goes through read_text, read_json and read_jsonl, which tolerate what a
crash, a full disk or a hand edit can leave (bytes that are not UTF-8, torn JSON, a list where an object
belongs, a string where a number belongs, a folder where a file belongs): the file is named in a warning,
once, and read as absent, or without the keys or lines that were wrong. A missing file is no warning.

Torch-free and standard library only: the launcher on the login node and the jobs on the nodes share it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from core import below

# The most a state file (job.json, summary.json, DONE, a config) may hold: far above what any writer here
# leaves, far below what fills a login node's memory (a DONE linked to /dev/zero was read without end).
# Files of rows (metrics, predictions) are streamed instead (iter_jsonl).
MAX_STATE_BYTES = 16 * 10**6


class NotARegularFile(OSError):
    """A FIFO, a device or a folder where a file belongs, or a file over its size bound: never read."""


def read_regular(path: Path, limit: int = MAX_STATE_BYTES) -> bytes:
    """A regular file's bytes, at most `limit`. Opened without blocking (a FIFO's open would wait for a
    writer: a FIFO named *.yaml or DONE hung the launch and --status) and checked before reading: anything
    but a regular file, or a file over `limit`, raises NotARegularFile naming what it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise NotARegularFile("a folder where a file belongs")
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile("not a regular file (a FIFO, a socket or a device)")
        if info.st_size > limit:
            raise NotARegularFile(f"larger than {limit:,} bytes ({info.st_size:,})")
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:  # it grew after its stat
                raise NotARegularFile(f"larger than {limit:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_window(path: Path, offset: int | None, limit: int) -> tuple[bytes, int]:
    """At most `limit` bytes of a regular file from `offset` (None: its last `limit` bytes), and the size
    it had: a job's log, read by --status and --tail while it grows. Opened as read_regular opens (a FIFO
    never waited on, a device such as /dev/zero behind a link refused: NotARegularFile), and bounded
    however large the file is or grows."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            what = "a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO, a socket or a device"
            raise NotARegularFile(errno.EINVAL, f"not a regular file ({what})", str(path))
        start = max(0, info.st_size - limit) if offset is None else offset
        return os.pread(fd, limit, start), info.st_size
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, root: Path | None = None) -> None:
    """Readers see the old file or the new one, never half of one; after return it is on disk.

    A temporary file in the same folder (a rename across file systems is a copy), flushed and synced,
    then renamed over the target; the folder is synced so the rename itself survives a node failure.
    With `root`, the folder is reached (and made) from it without following a link, just before."""
    path = Path(path)
    if root is None:
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        os.close(below.open_folder(root, path.parent, create=True))
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise naming(exc, path) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise naming(exc, path) from None
        raise
    fsync_path(path.parent)


def write_atomic_with(path: Path, write: Callable[[Path], None]) -> None:
    """A library's writer (matplotlib's savefig) aimed at a fresh temporary path in the same folder, then
    renamed over `path`: a link planted at `path` is replaced, never written through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_append(path: Path, binary: bool = False, root: Path | None = None) -> IO:
    """`path` opened to append, created if absent, never through a link: a symbolic link planted at it
    (a shared runs/ folder: `speeds.jsonl` -> someone's file) fails with ELOOP instead of receiving rows;
    with `root`, no folder between it and `path` may be a link either (core/below.py), at this moment.
    Only a regular file is appended to (a FIFO's open would wait for a reader: NotARegularFile instead).
    A file that does not end in a newline (a line torn by a kill mid-append) gets one first, so the torn
    line stays one bad line and the next record starts its own."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK
    fd = opened(path, flags, root)
    try:
        regular_or_refuse(fd, path)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab") if binary else os.fdopen(fd, "a", encoding="utf-8")


def open_lock(path: Path, root: Path | None = None) -> IO:
    """`path` opened to read and write (a lock file that holds its holder's name), created if absent, never
    through a link (nor, with `root`, through a linked folder below it), never truncated on opening; a
    FIFO, a folder or a device there is refused (NotARegularFile), never waited on."""
    fd = opened(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, root)
    try:
        regular_or_refuse(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "r+", encoding="utf-8")


def opened(path: Path, flags: int, root: Path | None) -> int:
    """A descriptor of `path`, never through a link at it (nor below `root`, when given)."""
    try:
        if root is not None:
            return below.open_file(root, path, flags)
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except IsADirectoryError:
        raise NotARegularFile(errno.EISDIR, "a folder where a file belongs", str(path)) from None


def regular_or_refuse(fd: int, path: Path) -> None:
    """NotARegularFile, naming `path`, unless `fd` is a regular file."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise NotARegularFile(errno.EINVAL, "not a regular file (a FIFO, a socket or a device)", str(path))


def append_json_line(path: Path, value: dict, root: Path | None = None) -> None:
    """One JSON line appended (open_append: a new line after a torn one, never through a link), strict
    JSON (json_line). A line shorter than the filesystem's atomic append never interleaves with another
    writer's."""
    with open_append(path, root=root) as fh:
        fh.write(json_line(value))
        fh.flush()


def json_line(value) -> str:
    """`value` as one line of strict JSON: a number that is not finite (NaN, Infinity, which json.dumps
    writes bare and other JSON readers refuse) is written null. Readers here accept both."""
    return json.dumps(finite_or_null(value), allow_nan=False) + "\n"


def finite_or_null(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def links_below(root: Path) -> list[Path]:
    """Every symbolic link below `root`, not followed (a linked folder is listed, never entered), but the
    ones our own tools make (`made_by_a_tool`). `root` itself may be a link: where the run root lives is
    the user's choice."""
    found = []
    for folder, folders, files in os.walk(root):
        found += [
            Path(folder, name)
            for name in (*folders, *files)
            if os.path.islink(os.path.join(folder, name)) and not made_by_a_tool(Path(folder, name))
        ]
    return sorted(found)


# The links W&B makes in its run folders (`wandb/latest-run`, `wandb/debug.log`, and in each run's logs
# `debug-core.log`, to its own cache): it replaces them on every run and writes through none of ours.
WANDB_LINKS = {"latest-run", "debug.log", "debug-internal.log", "debug-core.log"}


def made_by_a_tool(link: Path) -> bool:
    """A link W&B makes (WANDB_LINKS, below a `wandb` folder), or submitit (`.submission_file_UUID.sh`,
    kept beside the `JOBID_submission.sh` it was renamed to, in the same folder)."""
    if link.name in WANDB_LINKS and "wandb" in link.parent.parts:
        return True
    if link.name.startswith(".submission_file_") and link.suffix == ".sh":
        target, inside = os.path.realpath(link), os.path.realpath(link.parent)
        return os.path.commonpath([target, inside]) == inside
    return False


def naming(exc: OSError, path: Path) -> OSError:
    """The same error (a full disk, a read-only folder, a folder in the way), naming the file being
    written rather than its temporary file, or nothing at all (a failed write names no file)."""
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def write_json_atomic(path: Path, value, indent: int | None = None, root: Path | None = None) -> None:
    write_atomic(path, json.dumps(value, indent=indent) + "\n", root)


# What a key of a JSON object must hold: `float` is any number (an int too), never a bool; `int` not a bool.
Kind = type | tuple[type, ...]
_warned: set[tuple[str, str]] = set()


def warn_unreadable(path: Path, why: str, then: str = "ignored") -> None:
    """One line on stderr naming the file, what is wrong with it and what is done instead, once per process
    (a --wait loop reads the same files every few seconds)."""
    if (str(path), why) not in _warned:
        _warned.add((str(path), why))
        print(f"warning: {path}: {why}; {then}", file=sys.stderr, flush=True)


_commands = [0]  # the commands this process has begun (forget_warnings): what a per-command cache keys on


def forget_warnings() -> None:
    """Warn again (each command of a process that runs several says what it found)."""
    _warned.clear()
    _commands[0] += 1


def command_number() -> int:
    """Which command of this process runs now: a cache of what a command read (and warned about) is its own."""
    return _commands[0]


def read_text(path: Path, unreadable: str | None = None, then: str = "ignored") -> str | None:
    """The file's text; None when it is missing; `unreadable` when it is there but cannot be read as UTF-8
    text (a folder, no permission, other bytes): warned about, naming the file and `then`, what follows."""
    path = Path(path)
    try:
        return read_regular(path).decode("utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text (byte {exc.start + 1})"
    except NotARegularFile as exc:
        why = str(exc)
    except OSError as exc:
        why = f"cannot be read ({exc.strerror or exc})"
    warn_unreadable(path, why, then)
    return unreadable


def read_json(path: Path, default=None, expected: Kind | None = None, fields: dict[str, Kind] | None = None):
    """The file's JSON, or `default` when it is missing or unreadable (never an exception). `expected`: the
    type the whole value must have (dict, list); `fields`: for an object, the kind each key must hold when
    present and not null; keys that hold another are left out. Both are warned about, naming the file."""
    text = read_text(path)
    if text is None:
        return default
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        warn_unreadable(path, f"not JSON ({str(exc)[:80]})")
        return default
    if expected is not None and not is_kind(value, expected):
        warn_unreadable(path, f"holds {kind_name(type(value))}, not {kind_name(expected)}")
        return default
    if fields and isinstance(value, dict):
        value, wrong = typed(value, fields)
        if wrong:
            warn_unreadable(path, "; ".join(wrong))
    return value


def read_jsonl(path: Path, fields: dict[str, Kind] | None = None) -> list[dict]:
    """The JSON objects of a file of one per line (iter_jsonl), as a list: for files that stay small."""
    return list(iter_jsonl(path, fields))


MAX_LINE_BYTES = 1 << 20  # far above any row a writer here makes; a longer line is skipped, named


def iter_jsonl(path: Path, fields: dict[str, Kind] | None = None) -> Iterator[dict]:
    """The JSON objects of a file of one per line, read line by line (a 300 MB metrics.jsonl parsed whole
    took 6.9 GB), each checked as read_json checks `fields`. A last line without its newline that is no JSON
    object is being written (or was cut by a kill) and is skipped quietly; other lines that are not JSON
    objects, or longer than MAX_LINE_BYTES, are skipped and warned about, with their numbers. A FIFO or a
    device is never read (a warning names it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        warn_unreadable(Path(path), str(exc.strerror))
        return
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = (
            "a folder where a file belongs"
            if stat.S_ISDIR(mode)
            else "not a regular file (a FIFO, a socket or a device)"
        )
        warn_unreadable(Path(path), what)
        return
    with os.fdopen(fd, "rb") as fh:
        first_wrong, wrong, number = None, 0, 0
        while raw := fh.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                while (rest := fh.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                    pass  # the rest of that line
                row, why = None, f"longer than {MAX_LINE_BYTES:,} bytes"
            else:
                row, why = json_object(raw)
                if why and not raw.endswith(b"\n"):
                    break  # torn
            if row is not None and fields:
                row, bad = typed(row, fields)
                why = "; ".join(bad) or None
            if why:
                first_wrong, wrong = first_wrong or f"line {number}: {why}", wrong + 1
            if row is not None:
                yield row
        if wrong:
            more = f" (and {wrong - 1} more line(s))" if wrong > 1 else ""
            warn_unreadable(Path(path), first_wrong + more)


def thinned(rows: Iterable[dict], keep: int, curve: Callable[[dict], str]) -> list[dict]:
    """`rows` with at most 2 x `keep` of each curve (`curve(row)` names it), evenly spaced, its first and
    last kept, in their order: a plot or a mean of a million logged steps reads the same from a few
    thousand, in constant memory."""
    kept: dict[str, list[tuple[int, dict]]] = {}
    stride: dict[str, int] = {}
    seen: dict[str, int] = {}
    last: dict[str, tuple[int, dict]] = {}
    for index, row in enumerate(rows):
        name = curve(row)
        n = seen.get(name, 0)
        seen[name], last[name] = n + 1, (index, row)
        if n % stride.setdefault(name, 1) == 0:
            points = kept.setdefault(name, [])
            points.append((index, row))
            if len(points) > 2 * keep:
                kept[name], stride[name] = points[::2], stride[name] * 2
    for name, point in last.items():
        if kept[name][-1][0] != point[0]:
            kept[name].append(point)
    return [row for _, row in sorted((p for points in kept.values() for p in points), key=lambda p: p[0])]


def json_object(raw: bytes) -> tuple[dict | None, str | None]:
    """(the line's object, None) or (None, why not); (None, None) for a blank line."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(text) if text.strip() else None
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start + 1} of the line)"
    except (ValueError, RecursionError):
        return None, "not JSON"
    if value is not None and not isinstance(value, dict):
        return None, f"{kind_name(type(value))}, not an object"
    return value, None


def typed(value: dict, fields: dict[str, Kind]) -> tuple[dict, list[str]]:
    """(the object without the keys that hold the wrong kind, what was wrong)."""
    bad = [
        key for key, kind in fields.items() if value.get(key) is not None and not is_kind(value[key], kind)
    ]
    wrong = [f"{key} is {json.dumps(value[key])[:40]}, not {kind_name(fields[key])}" for key in bad]
    return ({k: v for k, v in value.items() if k not in bad} if bad else value), wrong


def is_kind(value, kind: Kind) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, tuple(int | float if k is float else k for k in kinds))


def kind_name(kind: Kind) -> str:
    names = {dict: "an object", list: "a list", str: "a string", float: "a number", int: "an integer"}
    names |= {bool: "true or false", type(None): "null"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def stderr_into(path: Path, root: Path | None = None):
    """Processes started meanwhile write their stderr into `path`, not the launcher's terminal: a Ctrl-C
    there reaches submitit's local controller too, which then prints a KeyboardInterrupt traceback (the
    launcher itself says what it stopped). The job's own output goes to its log, as ever. With `root` (the
    log root, the cache), `path` is reached from it without following a link (core/below.py)."""
    if root is None:
        path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open_append(path, root=root) as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
