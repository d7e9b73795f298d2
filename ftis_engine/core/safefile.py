"""The one writer of the files the commands write (figures, reports, summaries, records, logs): never through a
symbolic link, and a whole file or none.

A file is written in a folder of a directory the command owns (`root`: a run or study directory, or the folder a
user named for one file): every folder from `root` down to the file is a real folder, made where missing, and a
symbolic link (or a file) in the place of one is refused (LinkRefused), never followed out of the directory. It is
opened by a descriptor walked from `root` one folder at a time (O_NOFOLLOW), so a link planted while it writes is
refused too. `root` itself is followed: it is the path the user gave.

- write_bytes / write_text / write_json / save_figure: atomic. The bytes go to a temp file of a fresh random name
  in the same folder (created exclusively: never an existing file or a link), are flushed to disk, and replace the
  file's name in one rename: a reader sees the old file or the new one, never part of one; a link at the file's
  name is replaced by the file, its target untouched. The temp file is removed however the write fails.
- open_write: write_bytes's file for a writer that streams (torch.save), the same temp file and rename.
- write_folder: a folder a library writes whole (save_pretrained): into a fresh temp folder (made by this process,
  its mode 0o700), renamed to its name once written; a link (or a file) at that name is refused, never replaced.
- open_append: a log the command appends to a line at a time (metrics.jsonl, coordinator.jsonl, a study's launch
  records): opened without following a link at its name, and only a regular file.
- open_lock: a lock file (a run's .lock), created where missing, opened as open_append opens a log, never truncated.
- read_bytes / open_bounded: a file read whole (a run's own JSON, an id, an exit code) that a stranger could have
  planted or grown: only a regular file, and at most `limit` bytes (TooLarge, naming the file, otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pathlib
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TextIO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkRefused(OSError):
    """A symbolic link, or something that is not a folder or a regular file, where a folder or file the command
    writes goes (errno ENOTDIR or EPERM, filename the path): nothing is written through it. One line to the user:
    exits.py tells an OSError of this errno as a path to check, with exit code 2."""


def _parts(path: pathlib.Path, root: pathlib.Path) -> tuple[str, ...]:
    """The names from `root` down to `path` (its folders, then its own name); ValueError when `path` is not inside
    `root` or walks up out of it."""
    parts = pathlib.Path(path).relative_to(root).parts
    if not parts or any(part in ("..", ".") for part in parts):
        raise ValueError(f"{path}: not a file inside {root}")
    return parts


def _refused(path: pathlib.Path, what: str) -> LinkRefused:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = 0
    kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a folder" if what == "folder" else "not a regular file"
    code = errno.ENOTDIR if what == "folder" else errno.EPERM
    return LinkRefused(code, f"{kind} where a {what} the command writes goes: nothing is written through it; move it "
                             "away", str(path))


def open_folder(folder: pathlib.Path, root: pathlib.Path | None = None) -> int:
    """A descriptor of `folder` (a real folder under `root`, made where missing, each step of the way never a link:
    LinkRefused); the caller closes it. root None: `folder` itself, followed (the user's path)."""
    root = pathlib.Path(folder if root is None else root)
    parts = pathlib.Path(folder).relative_to(root).parts
    if any(part in ("..", ".") for part in parts):
        raise ValueError(f"{folder}: not a folder inside {root}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here, opened = root, False
    try:
        for part in parts:
            here = here / part
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o777, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    # from None: a one-line error for the user; the cause adds nothing to it
                    raise _refused(here, "folder") from None
                raise
            os.close(fd)
            fd = child
        opened = True
    finally:
        if not opened:
            os.close(fd)
    return fd


def _place(path: str | pathlib.Path, root: str | pathlib.Path | None) -> tuple[pathlib.Path, str, int]:
    """`path`, its file name and its folder opened without following a link (made under `root`, default the folder
    itself): where every writer here starts. The caller closes the folder's descriptor."""
    path = pathlib.Path(path)
    root = path.parent if root is None else pathlib.Path(root)
    return path, _parts(path, root)[-1], open_folder(path.parent, root)


def _temp_name(name: str) -> str:
    """A fresh hidden name beside `name` for what is written before it takes `name`."""
    return f".{name[:200]}.{secrets.token_hex(6)}.tmp"


@contextlib.contextmanager
def open_write(path: pathlib.Path, root: pathlib.Path | None = None) -> Iterator[BinaryIO]:
    """`path` opened to write bytes, as write_bytes writes them (atomic, never through a link; its folders made
    under `root`, default its own folder): the bytes go to a fresh temp file that takes `path`'s name when the block
    ends; however the block fails, the temp file is removed and `path` is as it was."""
    path, name, folder = _place(path, root)
    temp = _temp_name(name)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                     dir_fd=folder)
        replaced = False
        try:
            with open(fd, "wb", closefd=True) as out:
                yield out
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
            replaced = True
        finally:
            if not replaced:  # however it failed (a full disk, a Ctrl-C): no temp file stays
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=folder)
        with contextlib.suppress(OSError):  # the rename itself on disk (a crash now keeps the new file)
            os.fsync(folder)
    finally:
        os.close(folder)


def write_bytes(path: pathlib.Path, data: bytes, root: pathlib.Path | None = None) -> pathlib.Path:
    """Write `data` as the file `path` (see the module: atomic, never through a link; its folders made under `root`,
    default its own folder). Returns `path`."""
    with open_write(path, root) as out:
        out.write(data)
    return pathlib.Path(path)


def write_text(path: pathlib.Path, text: str, root: pathlib.Path | None = None) -> pathlib.Path:
    """write_bytes of `text` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"), root)


def write_json(path: pathlib.Path, value: Any, root: pathlib.Path | None = None,
               indent: int | None = 2) -> pathlib.Path:
    """write_bytes of `value` as strict JSON: a NaN or an infinity is a ValueError, never a bare NaN in the file (no
    JSON reader but Python's takes one)."""
    return write_text(path, json.dumps(value, indent=indent, allow_nan=False), root)


def save_figure(figure, path: pathlib.Path, root: pathlib.Path | None = None, **savefig) -> pathlib.Path:
    """A matplotlib figure drawn in memory in the format its suffix names (.png, .pdf, .svg), then write_bytes."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=pathlib.Path(path).suffix.lstrip(".").lower() or "png", **savefig)
    return write_bytes(path, buffer.getvalue(), root)


def open_append(path: pathlib.Path, root: pathlib.Path | None = None) -> TextIO:
    """`path` opened to append text (UTF-8), created where missing: never through a link at its name or in its
    folders (LinkRefused), and only a regular file (a FIFO would block the command)."""
    path, name, folder = _place(path, root)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o666, dir_fd=folder)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO nobody reads
            # from None: a one-line error for the user; the cause adds nothing to it
            raise _refused(path, "file") from None
        raise
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(path, "file")
    os.set_blocking(fd, True)
    return open(fd, "a", encoding="utf-8", closefd=True)


def write_folder(path: pathlib.Path, write: Callable[[pathlib.Path], None],
                 root: pathlib.Path | None = None) -> pathlib.Path:
    """The folder `path` as `write(folder)` writes it whole (save_pretrained): into a fresh temp folder beside it,
    made by this process (mode 0o700: no one else's file or link is inside it), then renamed to `path`. A link or a
    file at `path` is refused (LinkRefused), before anything is written and again at the rename; a folder there is
    replaced. However `write` fails, the temp folder is removed and `path` is as it was. The folders above it are
    made under `root` (default its own folder), never through a link; `write` is given the temp folder by a path
    through this process's descriptor of their last one (/proc/self/fd), so a folder above it swapped for a link
    while the library writes is never followed. Returns `path`."""
    import shutil

    path, name, folder = _place(path, root)
    temp = _temp_name(name)
    try:
        _refuse_non_folder(path, name, folder)
        os.mkdir(temp, 0o700, dir_fd=folder)
        placed = False
        try:
            via = pathlib.Path(f"/proc/self/fd/{folder}")
            write((via if via.is_dir() else path.parent) / temp)
            _refuse_non_folder(path, name, folder)
            try:
                os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except OSError as exc:  # a folder of an earlier write there (not empty): moved aside, then removed
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                old = f".{name[:200]}.{secrets.token_hex(6)}.old"
                os.replace(name, old, src_dir_fd=folder, dst_dir_fd=folder)
                os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
                shutil.rmtree(old, dir_fd=folder, ignore_errors=True)
            placed = True
        finally:
            if not placed:
                shutil.rmtree(temp, dir_fd=folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.fsync(folder)
    finally:
        os.close(folder)
    return path


def _refuse_non_folder(path: pathlib.Path, name: str, folder: int) -> None:
    """LinkRefused when something other than a real folder (a link, a file) is at `name` in `folder`."""
    try:
        mode = os.lstat(name, dir_fd=folder).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise _refused(path, "folder")


def open_lock(path: pathlib.Path, root: pathlib.Path | None = None) -> int:
    """A descriptor of the lock file `path` (read and write, for flock and its holder's line), created where
    missing, never truncated on opening: never through a link at its name or in its folders (LinkRefused), and
    only a regular file. The caller closes it."""
    path, name, folder = _place(path, root)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                     dir_fd=folder)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            # from None: the refusal names the path; the OS's ELOOP adds nothing to it
            raise _refused(path, "file") from None
        # from None: the same error, named by its path instead of its name alone
        raise OSError(exc.errno, exc.strerror, str(path)) from None  # named by its path, not by its name alone
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(path, "file")
    os.set_blocking(fd, True)
    return fd


class TooLarge(OSError):
    """A file read whole that holds more than the command reads of it (errno EFBIG, filename the path): not read.
    One line to the user: exits.py tells it as a path to check, with exit code 2."""


def open_bounded(path: pathlib.Path, limit: int, what: str = "file") -> BinaryIO:
    """`path` opened to read bytes, checked before a byte is read: a regular file (a FIFO, a device, a folder is
    refused: OSError naming it) of at most `limit` bytes (TooLarge naming it otherwise). `what` names the file in
    the message ("a wandb id file"). A link at its name is followed (the user may have placed one); what it reaches
    is checked alike. The caller closes it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    handle = None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, f"a folder where {what} is read: not read", str(path))
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EPERM, f"not a regular file where {what} is read: not read", str(path))
        if info.st_size > limit:
            raise _too_large(path, limit, what, info.st_size)
        os.set_blocking(fd, True)
        handle = open(fd, "rb", closefd=True)
    finally:
        if handle is None:  # refused (or interrupted): the descriptor is not handed on
            os.close(fd)
    return handle


def read_bytes(path: pathlib.Path, limit: int, what: str = "file") -> bytes:
    """The bytes of `path` (open_bounded's checks), never more than `limit` read: a file that grows past it while
    it is read is TooLarge too."""
    with open_bounded(path, limit, what) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise _too_large(path, limit, what)
    return data


def _too_large(path: pathlib.Path, limit: int, what: str, size: int | None = None) -> TooLarge:
    held = f"{size} bytes" if size is not None else "more"
    return TooLarge(errno.EFBIG, f"{held}, over the {limit} bytes {what} may hold: not read (planted there, or "
                                 "grown by another program? move it away)", str(path))
