"""Reading and writing shards in The Pile's format: one JSON object a line, ``*.jsonl.zst`` or plain ``*.jsonl``.

Each line is ``{"text": "...", "meta": {"pile_set_name": "Github"}}``. Reading streams (never a whole shard in
memory); every input problem is a one-line :class:`~repro.errors.ReproError` naming the file (and line).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import zstandard
from tqdm import tqdm

from repro.errors import ReproError
from repro.io_utils import atomic_path

# Compressed bytes read from disk per step: large enough for throughput, small enough to stream.
_READ_CHUNK = 1 << 20


class _StreamError(ReproError):
    """A zstd problem, raised while the text layer reads ahead; the caller adds how far reading got."""


class PileRecord(NamedTuple):
    """One document: its text and its domain (``meta.pile_set_name``)."""

    text: str
    domain: str


class _ZstdRawReader(io.RawIOBase):
    """Streaming zstd as a raw stream: unlike ``stream_reader`` (silent on truncation) it raises when the input
    ends inside a frame, and reads concatenated frames as the ``zstd`` tool does."""

    def __init__(self, fileobj: io.BufferedIOBase, path: Path) -> None:
        super().__init__()
        self._file, self._path = fileobj, path
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._frame_has_input = False  # whether the current frame has consumed any byte
        self._pending = b""  # decompressed bytes not yet handed out
        self._pos = 0
        self._eof = False

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        """Decompress until some output is pending or the input is exhausted."""
        while self._pos >= len(self._pending) and not self._eof:
            chunk = self._file.read(_READ_CHUNK)
            if not chunk:
                self._eof = True
                if self._frame_has_input and not self._frame.eof:
                    raise _StreamError(f"{self._path}: truncated zstd stream, the file ends inside a frame")
                return
            out = []
            while chunk:
                try:
                    out.append(self._frame.decompress(chunk))
                except zstandard.ZstdError as exc:
                    raise _StreamError(f"{self._path}: corrupt zstd stream ({exc})") from None
                self._frame_has_input = True
                if not self._frame.eof:
                    break
                # The frame ended inside this chunk: what follows starts the next frame.
                chunk = self._frame.unused_data
                self._frame = self._decompressor.decompressobj()
                self._frame_has_input = False
            self._pending, self._pos = b"".join(out), 0

    def readinto(self, buffer) -> int:  # type: ignore[override]
        self._fill()
        n = min(len(buffer), len(self._pending) - self._pos)
        buffer[:n] = self._pending[self._pos : self._pos + n]
        self._pos += n
        return n


def iter_pile_documents(paths: Sequence[str | os.PathLike], *, default_domain: str | None = None,
                        progress: bool = False) -> Iterator[PileRecord]:
    """Stream the documents of Pile-format shards, in order, one shard after the other.

    Args:
        paths: ``*.jsonl.zst`` (zstd, possibly several frames) or plain ``*.jsonl`` shards.
        default_domain: for records without ``meta.pile_set_name``; ``None``: an error.
        progress: tqdm bar over the (compressed) bytes read, per shard.

    Yields:
        :class:`PileRecord` ``(text, domain)`` for every non-blank line.
    """
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ReproError(f"{path}: no such file")
        size = path.stat().st_size
        lineno = 0
        with open(path, "rb") as raw, tqdm(total=size, unit="B", unit_scale=True, desc=path.name,
                                           disable=not progress, leave=False) as bar:
            stream = io.BufferedReader(_ZstdRawReader(raw, path), 1 << 16) if path.name.endswith(".zst") else raw
            text_stream = io.TextIOWrapper(stream, encoding="utf-8", newline="\n")
            try:
                for line in text_stream:
                    lineno += 1
                    if lineno % 4096 == 0 and progress:
                        bar.update(raw.tell() - bar.n)
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ReproError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                        raise ReproError(f"{path}:{lineno}: record has no 'text' string")
                    meta = obj.get("meta")
                    domain = meta.get("pile_set_name") if isinstance(meta, dict) else None
                    if not isinstance(domain, str) or not domain:
                        if default_domain is None:
                            raise ReproError(f"{path}:{lineno}: record has no 'meta.pile_set_name' "
                                             "(pass a default domain)")
                        domain = default_domain
                    yield PileRecord(obj["text"], domain)
            except (UnicodeDecodeError, _StreamError) as exc:
                # The text layer decodes ahead of the line being parsed, so name the last line read whole.
                where = f"after line {lineno}" if lineno else "before the first line"
                what = f"{path}: not valid UTF-8" if isinstance(exc, UnicodeDecodeError) else str(exc)
                raise ReproError(f"{what} ({where})") from None
            bar.update(size - bar.n)


def write_pile_shard(path: str | os.PathLike, records: Iterable[PileRecord]) -> int:
    """Write ``(text, domain)`` records as a Pile-format shard, atomically (nothing is left at ``path`` on
    failure); returns how many.

    Args:
        path: ``*.zst``: zstd (level 10, one frame, content checksum); else plain JSON lines.
    """
    path = Path(path)
    count = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        zst = path.name.endswith(".zst")
        sink = zstandard.ZstdCompressor(level=10, write_checksum=True).stream_writer(raw, closefd=False) if zst else raw
        for text, domain in records:
            line = json.dumps({"text": text, "meta": {"pile_set_name": domain}}, ensure_ascii=False)
            sink.write(line.encode("utf-8") + b"\n")
            count += 1
        if sink is not raw:
            sink.close()  # ends the frame (closefd=False keeps ``raw`` open for the with-block)
    return count
