"""GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, through HF ``tokenizers``.

One loading path serves OpenAI's GPT-2 files (The Pile) and the tokenizer trained on the mini-pile
(:func:`train_bpe_tokenizer` writes the same two files). :class:`Gpt2BpeTokenizer` carries what megatron-core's
datasets read from a tokenizer, so it is passed as ``GPTDatasetConfig.tokenizer`` directly; it is duck-typed
so that importing it does not import megatron-core.
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

#: Longest piece of text handed to the BPE encoder in one call (characters). HF ``tokenizers`` holds about
#: 155 bytes per character while it encodes one string (``ru_maxrss``), so a 50 M-character document took
#: 9.09 GB to tokenise (1.51 GB in pieces, byte-identical output: ``/usr/bin/time -v python -m repro data
#: tokenize --workers 1``); about 160 MB per encoding thread in pieces (:func:`split_for_encoding`).
MAX_CHUNK_CHARS = 1 << 20

# A non-whitespace character followed by a space or newline: GPT-2's pre-tokenizer never puts the two into
# one pre-token (no alternative of its regex matches non-space then space), and BPE never merges across
# pre-tokens, so cutting between them leaves every token as it was.
_SAFE_CUT = re.compile(r"[^\s](?=[ \n])")
_CUT_SEARCH = 1 << 16  # characters searched per step, from the end of the window backwards


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
        # Without merges BPE falls back to single bytes: a corpus would tokenise (about one token per byte)
        # and train, silently, on the wrong vocabulary. An empty file is a copy or download gone wrong.
        raise ReproError(f"{path}: no merges (the file is empty or holds only its header); expected GPT-2's "
                         "merges.txt, one 'left right' pair a line")


class Gpt2BpeTokenizer:
    """GPT-2 byte-level BPE with the end-of-document token; usable as megatron-core's dataset tokenizer.

    ``<|endoftext|>`` is looked up in the vocabulary but not registered as a special token: text containing
    that string is encoded as ordinary bytes, so the only EOD ids in a corpus are the ones appended at
    document ends (what megatron's ``eod_mask_loss``/``reset_*`` options rely on).

    Args:
        vocab_path: ``vocab.json`` (token -> id).
        merges_path: ``merges.txt``.

    Raises:
        ReproError: either file is missing or does not parse, or the vocabulary has no ``<|endoftext|>``.
    """

    def __init__(self, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> None:
        self.vocab_path = Path(vocab_path)
        self.merges_path = Path(merges_path)
        vocab = _read_vocab(self.vocab_path)
        if EOD_TOKEN not in vocab:
            raise ReproError(f"{self.vocab_path}: vocabulary has no end-of-document token {EOD_TOKEN}")
        _check_merges(self.merges_path, vocab)
        try:
            model = models.BPE.from_file(str(self.vocab_path), str(self.merges_path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ReproError(f"{self.vocab_path}: cannot load BPE vocabulary/merges ({exc})") from None
        tok = Tokenizer(model)
        # GPT-2: bytes mapped to printable unicode, GPT-2's split regex, no space added before the text.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self.vocab = vocab  # token string -> id
        self.eod = self.eos = vocab[EOD_TOKEN]  # GPT-2 has one end token
        self.vocab_size = max(vocab.values()) + 1  # max id + 1; the model pads it for its embedding table
        # content hashes, so megatron's index cache follows the vocabulary, not the file name
        self.unique_identifiers = OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                                               ("vocab_sha256", _sha256(self.vocab_path)),
                                               ("merges_sha256", _sha256(self.merges_path))])

    def tokenize(self, text: str) -> list[int]:
        """Encode one text (no EOD appended); long texts in pieces (:func:`split_for_encoding`), same ids."""
        return self.encode_arrays([text])[0].tolist()

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode ids back to text (byte-level: exact for any text that was encoded)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts (no EOD appended); releases the GIL while it runs."""
        return [ids.tolist() for ids in self.encode_arrays(texts)]

    def encode_arrays(self, texts: Sequence[str], dtype=np.int64) -> list[np.ndarray]:
        """Encode several texts (no EOD appended) into one id array each, with bounded memory: pieces of
        :func:`split_for_encoding` go to the encoder in calls of at most :data:`MAX_CHUNK_CHARS` in all."""
        encode = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch  # fast: no offsets
        limit = MAX_CHUNK_CHARS
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        group: list[str] = []
        owners: list[int] = []
        size = 0

        def flush() -> None:
            for owner, encoding in zip(owners, encode(group, add_special_tokens=False)):
                parts[owner].append(np.asarray(encoding.ids, dtype=dtype))
            group.clear()
            owners.clear()

        for i, text in enumerate(texts):
            for piece in split_for_encoding(text, limit):
                if group and size + len(piece) > limit:
                    flush()
                    size = 0
                group.append(piece)
                owners.append(i)
                size += len(piece)
        if group:
            flush()
        empty = np.zeros(0, dtype=dtype)
        return [p[0] if len(p) == 1 else np.concatenate(p) if p else empty for p in parts]

    def __repr__(self) -> str:
        return f"Gpt2BpeTokenizer(vocab={str(self.vocab_path)!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def split_for_encoding(text: str, max_chars: int | None = None) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars`` (default :data:`MAX_CHUNK_CHARS`) characters whose
    encodings, concatenated, equal its own (``"".join(pieces) == text``).

    Each cut falls as late as possible just before a space or newline that follows a non-whitespace
    character, where GPT-2's pre-tokenizer splits anyway. A longer stretch without such a place (a base64
    blob) is cut at ``max_chars``: the only case where the ids can differ, the price of bounded memory.
    """
    limit = MAX_CHUNK_CHARS if max_chars is None else max_chars
    if limit < 2:
        raise ValueError(f"max_chars must be >= 2, got {limit}")
    if len(text) <= limit:
        return [text]
    pieces = []
    start = 0
    while len(text) - start > limit:
        end = start + limit  # the piece is text[start:cut], start < cut <= end (and end < len(text))
        cut = end  # no safe place in the whole window: a hard cut
        hi = end
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


def load_tokenizer(vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> Gpt2BpeTokenizer:
    """Load a GPT-2-format tokenizer from ``vocab.json`` and ``merges.txt``."""
    return Gpt2BpeTokenizer(vocab_path, merges_path)


TOKENIZER_FILES = ("vocab.json", "merges.txt")


def is_tokenizer_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a tokenizer's ``vocab.json``/``merges.txt`` and nothing else
    (what :func:`train_bpe_tokenizer` writes, so it may replace it)."""
    try:
        names = {p.name for p in Path(path).iterdir()}
    except OSError:
        return False
    return names <= set(TOKENIZER_FILES)


def train_bpe_tokenizer(
    texts: Iterable[str], out_dir: str | os.PathLike, *, vocab_size: int = 8192, min_frequency: int = 2
) -> tuple[Path, Path]:
    """Train a GPT-2-style byte-level BPE on ``texts`` and save it as ``vocab.json`` + ``merges.txt``, atomically;
    the vocabulary holds ``<|endoftext|>`` (id 0) and the 256 byte symbols, so any text can be encoded.

    Args:
        texts: the training texts.
        out_dir: the directory to write; an existing one is replaced only when it is a tokenizer directory
            (:func:`is_tokenizer_dir`).
        vocab_size: the vocabulary size, ``<|endoftext|>`` included.
        min_frequency: the least count for a pair to be merged.

    Returns:
        ``(vocab_path, merges_path)``.
    """
    if vocab_size < 257 + 1:
        raise ReproError(f"vocab_size {vocab_size} is too small: byte-level BPE needs at least 258")
    out = Path(out_dir)
    check_output_path(out, replace=is_tokenizer_dir)  # before the training, which may take minutes
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD_TOKEN], show_progress=False
    )
    with atomic_path(out, replace=is_tokenizer_dir) as tmp:
        tmp.mkdir()
        bpe.save_model(str(tmp))
    return out / "vocab.json", out / "merges.txt"


def encode_documents(
    tokenizer: Gpt2BpeTokenizer, texts: Iterable[str], *, num_workers: int | None = None, batch_size: int = 256
) -> Iterator[np.ndarray]:
    """Encode a stream of documents on several cores, in order, with bounded memory.

    HF ``tokenizers`` releases the GIL while encoding, so a thread pool runs in parallel whatever
    ``TOKENIZERS_PARALLELISM`` says; at most ``2 * num_workers`` batches are in flight.

    Yields:
        One int64 array of token ids per document of ``texts``, in order, the EOD id appended; encoded in
        batches of ``batch_size`` by ``num_workers`` threads (default: all cores).
    """
    workers = max(1, num_workers or os.cpu_count() or 1)
    eod = np.asarray([tokenizer.eod], dtype=np.int64)

    def encode(batch: list[str]) -> list[np.ndarray]:
        return [np.concatenate([ids, eod]) for ids in tokenizer.encode_arrays(batch)]

    def batches() -> Iterator[list[str]]:
        stream = iter(texts)
        while batch := list(itertools.islice(stream, batch_size)):
            yield batch

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize") as pool:
        in_flight: list[Future] = []
        for batch in batches():
            in_flight.append(pool.submit(encode, batch))
            if len(in_flight) >= 2 * workers:
                yield from in_flight.pop(0).result()
        for fut in in_flight:
            yield from fut.result()
