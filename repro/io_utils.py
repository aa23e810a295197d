"""Safe writes: readers never see a partial file, failures leave nothing behind, nothing the writer did not
make is removed or written through.

Rules (docs/failures.md): a file is replaced atomically unless ``replace`` (recognising the command's own
output) says no; a directory only if ``replace`` recognises it; a symlink or special file never. An ``OSError``
becomes one :class:`ReproError` line, ``"<cause>: <path>"``, after the write's temporaries are removed.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from repro.errors import ReproError

#: ``replace(path) -> bool``: whether what exists at ``path`` is the command's own earlier output.
Recognise = Callable[[Path], bool]


def os_error_message(exc: BaseException, path: str | os.PathLike) -> str:
    """One line for a failed write: ``"<cause>: <path>"`` (``no space left on device: runs/x``).

    Args:
        exc: the ``OSError``, or an exception chaining one (torch's zip writer raises ``RuntimeError``).
        path: the user's output path, not a temporary name.
    """
    os_exc = find_os_error(exc)
    if os_exc is not None and os_exc.errno:
        cause = os.strerror(os_exc.errno)
    else:
        cause = str(os_exc or exc).strip().splitlines()[0] if str(os_exc or exc).strip() else type(exc).__name__
    return f"{cause[:1].lower()}{cause[1:]}: {path}"


def find_os_error(exc: BaseException | None) -> OSError | None:
    """The first ``OSError`` in ``exc``'s cause/context chain (itself first), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def error_from_os_error(
    exc: BaseException, path: str | os.PathLike, temp_dir: str | os.PathLike | None = None
) -> ReproError | None:
    """The one-line :class:`ReproError` for an ``OSError`` in ``exc``'s chain (None if there is none).

    Args:
        exc: the exception caught while writing.
        path: the user's output (reported unless the error names another file).
        temp_dir: the writer's temporary directory; errors inside it are reported as ``path``.
    """
    os_exc = find_os_error(exc)
    if os_exc is None:
        return None
    where: str | os.PathLike = path
    if os_exc.filename and not (temp_dir is not None and str(os_exc.filename).startswith(str(temp_dir))):
        where = os_exc.filename
    return ReproError(os_error_message(os_exc, where))


def _kind(path: Path) -> str | None:
    """``"file"``, ``"dir"``, ``"symlink"``, ``"other"``, or None when nothing is there (links not followed)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a parent that is a file: reported when the write creates it
        return None
    for kind, test in (("symlink", stat.S_ISLNK), ("dir", stat.S_ISDIR), ("file", stat.S_ISREG)):
        if test(mode):
            return kind
    return "other"


def check_output_path(path: str | os.PathLike, replace: Recognise | None = None, *, probe: bool = False) -> None:
    """Refuse, before any work, an output path the module's rules forbid replacing (re-checked on commit).

    Args:
        replace: recognises the command's own earlier output (None: files may be replaced, directories not).
        probe: also create and remove a temporary file beside ``path``, to report unwritable parents now.
    """
    final = Path(path)
    kind = _kind(final)
    if kind == "symlink":
        raise ReproError(f"{final}: is a symbolic link; refusing to replace it or write through it")
    if kind == "other":
        raise ReproError(f"{final}: exists and is not a regular file or directory; refusing to replace it")
    if kind == "dir" and (replace is None or not replace(final)):
        raise ReproError(f"{final}: exists and is a directory this command did not write; refusing to replace it "
                         "(choose a new path)")
    if kind == "file" and replace is not None and not replace(final):
        raise ReproError(f"{final}: exists and was not written by this command; refusing to overwrite it")
    if probe:
        tmp_dir, created = make_temp_dir(final)
        tmp_dir.rmdir()
        remove_empty_dirs(created)


def make_parents(directory: str | os.PathLike, where: str | os.PathLike | None = None) -> list[Path]:
    """``mkdir -p directory``, errors naming ``where``; returns the directories created, outermost first."""
    directory = Path(directory)
    where = directory if where is None else Path(where)
    missing = list(itertools.takewhile(lambda p: _kind(p) is None and p != p.parent, [directory, *directory.parents]))
    created = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except FileExistsError:
        pass  # made meanwhile by another writer, or a regular file (refused below)
    except OSError as exc:
        remove_empty_dirs(created)
        raise ReproError(os_error_message(exc, where)) from None
    if not directory.is_dir():
        remove_empty_dirs(created)
        raise ReproError(os_error_message(OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)), where))
    return created


def make_temp_dir(final: str | os.PathLike) -> tuple[Path, list[Path]]:
    """A new temporary directory ``.<name>.<random>.tmp`` beside ``final``, missing parents made first.

    Returns:
        ``(directory, parents made)`` (for :func:`remove_empty_dirs`).
    """
    final = Path(final)
    created = make_parents(final.parent, final)
    try:
        return Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)), created
    except OSError as exc:
        remove_empty_dirs(created)
        raise ReproError(os_error_message(exc, final)) from None


def remove_empty_dirs(created: list[Path]) -> None:
    """Remove the directories :func:`make_parents` created, innermost first, each only if still empty."""
    for d in reversed(created):
        with contextlib.suppress(OSError):
            d.rmdir()  # only if still empty: never removes what another writer put there meanwhile


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, replace: Recognise | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``, on error delete it.

    The module's rules are checked before the body and again before the rename (``replace``: as
    :func:`check_output_path`). A replaced directory is moved aside first, so a failed rename puts it back.
    """
    final = Path(path)
    check_output_path(final, replace)
    tmp_dir, created = make_temp_dir(final)
    tmp = tmp_dir / final.name
    ok = False
    try:
        try:
            yield tmp
        except ReproError:
            raise
        except Exception as exc:
            error = error_from_os_error(exc, final, tmp_dir)
            if error is None:
                raise
            raise error from None
        _commit(tmp, final, tmp_dir, replace)
        ok = True
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # ours: made by mkdtemp above
        if not ok:
            remove_empty_dirs(created)


def _commit(tmp: Path, final: Path, tmp_dir: Path, replace: Recognise | None) -> None:
    """Rename ``tmp`` onto ``final``, re-checking the module's rules (the body may have run long)."""
    check_output_path(final, replace)
    kind, new_is_dir = _kind(final), tmp.is_dir() and not tmp.is_symlink()
    try:
        if kind == "dir":
            if not new_is_dir:
                raise ReproError(f"{final}: exists and is a directory; refusing to replace it with a file")
            aside = tmp_dir / ".replaced"
            os.replace(final, aside)  # recognised by ``replace``: moved aside, deleted with tmp_dir
            try:
                os.replace(tmp, final)
            except OSError:
                os.replace(aside, final)
                raise
        else:
            if kind == "file" and new_is_dir:
                raise ReproError(f"{final}: exists and is not a directory; refusing to replace it with one")
            os.replace(tmp, final)
        with contextlib.suppress(OSError):  # make the rename durable (some file systems cannot fsync a directory)
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as exc:
        raise ReproError(os_error_message(exc, final)) from None


def write_synced(path: str | os.PathLike, mode: str, write: Callable[[Any], Any]) -> None:
    """``write(f)`` into ``path`` opened with ``mode``, flushed and fsynced before it is closed."""
    with open(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: str | os.PathLike, obj: Any, *, replace: Recognise | None = None) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (:func:`atomic_path`, with ``replace``)."""
    with atomic_path(path, replace=replace) as tmp:
        write_synced(tmp, "w", lambda f: f.write(json.dumps(obj, indent=2) + "\n"))


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """The parsed JSON file at ``path``, or ``default`` when it is missing, unreadable or not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def check_output_dir(path: str | os.PathLike, marker: str, command: str) -> None:
    """Refuse an ``--out`` directory unless new, empty, or ``command``'s earlier output (holds ``marker``)."""
    out = Path(path)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ReproError(f"{out}: exists and is not a directory; choose a new --out")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise ReproError(f"{out}: exists and was not written by {command} (no {marker}); choose a new --out")


def claim_output_dir(path: str | os.PathLike, marker: str, command: str) -> Path:
    """:func:`check_output_dir`, then create the directory, mark it as ``command``'s output and return it."""
    check_output_dir(path, marker, command)
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / marker).write_text(f"written by {command}\n")
    except OSError as exc:
        raise ReproError(os_error_message(exc, out)) from None
    return out


def claim_run_dir(run_dir: Path, *, marker: str, owner: str, command: str, keep: bool = False) -> None:
    """Make ``run_dir`` a run directory of this command (it holds ``marker``); refuse one it did not create.

    Args:
        run_dir, marker: the run directory; the file marking one this command created.
        owner: the command in words, for the error (``the mini comparison``).
        command: the command line written into the marker.
        keep: keep an existing directory of this command (to resume), else empty it.
    """
    if run_dir.is_symlink():  # never replaced, nor followed: what it points at is not this command's
        raise ReproError(f"{run_dir}: is a symbolic link; move it away or choose another --work-dir")
    if run_dir.exists():
        if not (run_dir / marker).is_file():
            raise ReproError(f"{run_dir}: exists and was not created by {owner}; move it away or choose another --work-dir")
        if keep:
            return
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / marker).write_text(f"created by {command}\n")


#: :func:`open_in_dir`'s modes (no ``x`` or ``+``: nothing needs them).
_OPEN_FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
               "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


def open_in_dir(root: str | os.PathLike, name: str | os.PathLike, mode: str = "r", **kwargs: Any) -> IO:
    """``open(root / name, mode)``, refusing a path that leaves ``root`` (``..``, or a symlink pointing out).

    So a planted symlink cannot redirect a run's writes; ``O_NOFOLLOW`` also refuses a link swapped in after the
    check. ``mode``: ``r``, ``w`` or ``a`` (with ``b``/``t``); ``kwargs`` go to :func:`os.fdopen`.
    """
    root_path = Path(root)
    path = root_path / name
    real_root, real = os.path.realpath(root_path), os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise ReproError(f"{path}: leads outside {root_path} (a symbolic link or '..'); refusing to open it")
    flags = _OPEN_FLAGS.get(mode.replace("b", "").replace("t", ""))
    if flags is None:
        raise ValueError(f"open_in_dir: mode {mode!r} is not one of r, w, a (with b or t)")
    try:
        fd = os.open(real, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ReproError(f"{path}: became a symbolic link while being opened; refusing to follow it") from None
        raise ReproError(os_error_message(exc, path)) from None
    return os.fdopen(fd, mode, **kwargs)


def comma_list(text: str) -> list[str]:
    """An argparse type: ``"a, b,,c"`` -> ``["a", "b", "c"]`` (for task, format and router lists)."""
    return [item.strip() for item in text.split(",") if item.strip()]
