"""Atomic file and directory writes: readers never see a partial file, failures leave nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``, on error delete it.

    Works for a file or a directory written at the yielded path.

    Args:
        path: the final destination.

    Yields:
        The temporary path to write to (it does not exist yet).
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    tmp = tmp_dir / final.name
    try:
        yield tmp
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
