"""GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, through HF ``tokenizers``.

For GPT-2's files and the mini-pile's; duck-types megatron's dataset tokenizer (importing it skips megatron).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.implementations import ByteLevelBPETokenizer

from repro.errors import ReproError
from repro.io_utils import atomic_path, check_output_path

#: GPT-2's end-of-document token, appended to every document.
EOD_TOKEN = "<|endoftext|>"

#: Most characters per encoder call (HF ``tokenizers`` holds ~155 bytes per character): bounds memory.
MAX_CHUNK_CHARS = 1 << 20

# Non-space then space/newline: GPT-2's pre-tokenizer always splits there, so a cut changes no token.
_SAFE_CUT = re.compile(r"[^\s](?=[ \n])")
_CUT_SEARCH = 1 << 16  # characters searched per step, from the end of the window backwards


def _read_text(path: Path, what: str) -> str:
    if not path.is_file():
        raise ReproError(f"{path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ReproError(f"{path}: {what} is not valid UTF-8") from None


def _read_vocab(path: Path) -> dict[str, int]:
    """Parse ``vocab.json`` (token -> id), raising a ReproError naming the file and line on any problem."""
    text = _read_text(path, "vocabulary")
    try:
        vocab = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReproError(f"{path}:{exc.lineno}: vocabulary is not valid JSON ({exc.msg})") from None
    if not isinstance(vocab, dict) or not vocab:
        raise ReproError(f"{path}: vocabulary must be a non-empty JSON object of token -> id")
    ids = list(vocab.values())
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ReproError(f"{path}: vocabulary ids must be non-negative integers")
    if len(set(ids)) != len(ids):
        raise ReproError(f"{path}: vocabulary has repeated ids")
    return vocab


def _check_merges(path: Path, vocab: dict[str, int]) -> None:
    """Check ``merges.txt``: an optional ``#version`` header, then one ``left right`` pair a line."""
    merges = 0
    for lineno, line in enumerate(_read_text(path, "merges file").split("\n"), start=1):
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ReproError(f"{path}:{lineno}: a merge must be two tokens separated by one space")
        if parts[0] + parts[1] not in vocab:
            raise ReproError(f"{path}:{lineno}: merge result '{parts[0] + parts[1]}' is not in the vocabulary")
        merges += 1
    if merges == 0:
        # Without merges BPE silently falls back to one token per byte: an empty file is a broken copy.
        raise ReproError(f"{path}: no merges (the file is empty or holds only its header); expected GPT-2's "
                         "merges.txt, one 'left right' pair a line")


class Gpt2BpeTokenizer:
    """GPT-2 byte-level BPE from ``vocab.json`` (token -> id) and ``merges.txt``; ``<|endoftext|>`` is not special
    (in text it encodes as bytes), so the only EOD ids are appended ones, as megatron's ``eod_mask_loss``/``reset_*``
    assume.

    Raises:
        ReproError: a file missing or unparsable, or no ``<|endoftext|>`` in the vocabulary.
    """

    def __init__(self, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> None:
        self.vocab_path, self.merges_path = Path(vocab_path), Path(merges_path)
        vocab = _read_vocab(self.vocab_path)
        if EOD_TOKEN not in vocab:
            raise ReproError(f"{self.vocab_path}: vocabulary has no end-of-document token {EOD_TOKEN}")
        _check_merges(self.merges_path, vocab)
        try:
            model = models.BPE.from_file(str(self.vocab_path), str(self.merges_path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ReproError(f"{self.vocab_path}: cannot load BPE vocabulary/merges ({exc})") from None
        self._tok = Tokenizer(model)
        # GPT-2: bytes mapped to printable unicode, GPT-2's split regex, no space added before the text.
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab = vocab  # token string -> id
        self.eod = self.eos = vocab[EOD_TOKEN]  # GPT-2 has one end token
        self.vocab_size = max(vocab.values()) + 1  # max id + 1; the model pads it for its embedding table
        # content hashes, so megatron's index cache follows the vocabulary, not the file name
        sha256 = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (self.vocab_path, self.merges_path)]
        self.unique_identifiers = OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                                               ("vocab_sha256", sha256[0]), ("merges_sha256", sha256[1])])

    def tokenize(self, text: str) -> list[int]:
        """Encode one text (no EOD appended); long texts in pieces (:func:`split_for_encoding`), same ids."""
        return self.encode_arrays([text])[0].tolist()

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode ids back to text (byte-level: exact for any text that was encoded)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode texts (no EOD) to int64 id arrays in bounded memory: calls of <= :data:`MAX_CHUNK_CHARS` in all
        (the GIL released while they run)."""
        encode = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch  # fast: no offsets
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        group: list[str] = []
        owners: list[int] = []

        def flush() -> None:
            for owner, encoding in zip(owners, encode(group, add_special_tokens=False)):
                parts[owner].append(np.asarray(encoding.ids, dtype=np.int64))
            group.clear()
            owners.clear()

        size = 0
        for i, text in enumerate(texts):
            for piece in split_for_encoding(text, MAX_CHUNK_CHARS):
                if group and size + len(piece) > MAX_CHUNK_CHARS:
                    flush()
                    size = 0
                group.append(piece)
                owners.append(i)
                size += len(piece)
        if group:
            flush()
        return [p[0] if len(p) == 1 else np.concatenate(p) for p in parts]  # every text has >= 1 piece

    def __repr__(self) -> str:
        return f"Gpt2BpeTokenizer(vocab={str(self.vocab_path)!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def split_for_encoding(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` into pieces of <= ``max_chars`` whose encodings concatenate to its own: as late as
    possible at a :data:`_SAFE_CUT`, else hard (a base64 blob: the only case where ids can differ)."""
    if max_chars < 2:
        raise ValueError(f"max_chars must be >= 2, got {max_chars}")
    pieces, start = [], 0
    while len(text) - start > max_chars:
        end = start + max_chars  # the piece is text[start:cut], start < cut <= end (and end < len(text))
        cut = hi = end  # no safe place in the whole window: a hard cut
        while hi > start:
            lo = max(start, hi - _CUT_SEARCH)
            # a match at k: text[k] is not whitespace and text[k + 1] is a space or newline, so cut at k + 1
            found = [m.start() + 1 for m in _SAFE_CUT.finditer(text, lo, hi + 1)]
            if found:
                cut = found[-1]
                break
            hi = lo
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


load_tokenizer = Gpt2BpeTokenizer


def is_tokenizer_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds only ``vocab.json``/``merges.txt`` (so :func:`train_bpe_tokenizer` may replace it)."""
    try:
        names = {p.name for p in Path(path).iterdir()}
    except OSError:
        return False
    return names <= {"vocab.json", "merges.txt"}


def train_bpe_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, *, vocab_size: int = 8192,
                        min_frequency: int = 2) -> tuple[Path, Path]:
    """Train a byte-level BPE (``<|endoftext|>`` id 0, all 256 bytes); save ``vocab.json``/``merges.txt`` atomically
    and return their paths.

    Args:
        out_dir: replaced only if :func:`is_tokenizer_dir`.
        vocab_size: ``<|endoftext|>`` included.
        min_frequency: least pair count to merge.
    """
    if vocab_size < 257 + 1:
        raise ReproError(f"vocab_size {vocab_size} is too small: byte-level BPE needs at least 258")
    out = Path(out_dir)
    check_output_path(out, replace=is_tokenizer_dir)  # before the training, which may take minutes
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD_TOKEN],
                            show_progress=False)
    with atomic_path(out, replace=is_tokenizer_dir) as tmp:
        tmp.mkdir()
        bpe.save_model(str(tmp))
    return out / "vocab.json", out / "merges.txt"


def encode_documents(tokenizer: Gpt2BpeTokenizer, texts: Iterable[str], *,
                     num_workers: int | None = None) -> Iterator[np.ndarray]:
    """Encode documents in order on ``num_workers`` threads (HF ``tokenizers`` releases the GIL), at most
    ``2 * num_workers`` batches of 256 in flight.

    Yields:
        One int64 id array per document, in order, EOD appended.
    """
    workers = max(1, num_workers or os.cpu_count() or 1)
    eod = np.asarray([tokenizer.eod], dtype=np.int64)

    def encode(batch: list[str]) -> list[np.ndarray]:
        return [np.concatenate([ids, eod]) for ids in tokenizer.encode_arrays(batch)]

    stream = iter(texts)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize") as pool:
        in_flight: list[Future] = []
        while batch := list(itertools.islice(stream, 256)):
            in_flight.append(pool.submit(encode, batch))
            if len(in_flight) >= 2 * workers:
                yield from in_flight.pop(0).result()
        for fut in in_flight:
            yield from fut.result()
