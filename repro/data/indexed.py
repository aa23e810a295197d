"""Tokenise Pile-format shards into megatron-core's indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``).

One *sequence* per document (tokens then EOD); domain sidecar ``PREFIX.domains.json`` (``{"domains": [...],
"num_documents": N}`` + counts) and ``PREFIX.domains.npy`` (domain index per document). All four are renamed into
place only after everything succeeded; existing files are replaced only if their ``.domains.json`` (renamed
first) marks them as this writer's, else refused before any work.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tqdm import tqdm

from repro.data.pile import iter_pile_documents
from repro.data.tokenizer import Gpt2BpeTokenizer, encode_documents
from repro.errors import ReproError
from repro.io_utils import check_output_path, error_from_os_error, make_temp_dir, read_json, remove_empty_dirs

DOMAINS_JSON = ".domains.json"
DOMAINS_NPY = ".domains.npy"


@dataclass(frozen=True)
class TokenizeStats:
    """Documents, tokens (with EOD) and UTF-8 bytes written, in total and per domain, and the wall time."""

    prefix: str
    num_documents: int
    num_tokens: int
    seconds: float
    documents: dict[str, int]
    tokens: dict[str, int]
    bytes: dict[str, int]

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


def write_domain_sidecar(prefix: str, names: list[str], doc_domain: Sequence[int], **meta: object) -> None:
    """Write ``prefix``'s domain sidecar: ``.domains.npy`` (``doc_domain``, indices into ``names``, in the smallest
    unsigned dtype) and ``.domains.json`` (``names``, the document count, then ``meta``)."""
    dtype = np.uint8 if len(names) <= 1 << 8 else np.uint16 if len(names) <= 1 << 16 else np.uint32
    np.save(prefix + DOMAINS_NPY, np.asarray(doc_domain, dtype=dtype))
    sidecar = {"domains": names, "num_documents": len(doc_domain), **meta}
    Path(prefix + DOMAINS_JSON).write_text(json.dumps(sidecar, indent=2))


def dataset_fingerprint(prefix: str) -> str:
    """Hash of an indexed dataset's identity: its whole index file, its data size and its domain sidecar."""
    with open(prefix + ".idx", "rb") as f:
        h = hashlib.file_digest(f, "sha256")
    h.update(str(os.path.getsize(prefix + ".bin")).encode())
    for ext in (DOMAINS_JSON, DOMAINS_NPY):
        path = prefix + ext
        h.update(Path(path).read_bytes() if os.path.isfile(path) else b"-")
    return h.hexdigest()


def prefix_files(prefix: str) -> list[str]:
    """An indexed dataset's files in rename order: ``.domains.json`` first (marks the set as the writer's),
    ``.idx`` last (it makes a prefix "exist")."""
    return [prefix + DOMAINS_JSON, prefix + DOMAINS_NPY, prefix + ".bin", prefix + ".idx"]


def check_indexed_output(prefix: str | os.PathLike) -> None:
    """Raise a ReproError naming the first of the prefix's four files that the writer may not replace."""
    prefix = str(prefix)
    meta = None if os.path.islink(prefix + DOMAINS_JSON) else read_json(prefix + DOMAINS_JSON)
    ours = isinstance(meta, dict) and isinstance(meta.get("domains"), list) and "num_documents" in meta
    for path in prefix_files(prefix):
        check_output_path(path, replace=lambda _p: ours)


def tokenize_shards(inputs: Sequence[str | os.PathLike], tokenizer: Gpt2BpeTokenizer, out_prefix: str | os.PathLike, *,
                    num_workers: int | None = None, default_domain: str | None = None,
                    progress: bool = False) -> TokenizeStats:
    """Tokenise Pile-format shards (EOD appended to each document) into one indexed dataset with its domain
    sidecar, atomically.

    Args:
        inputs: the shards, read in order.
        tokenizer: token dtype is megatron's ``DType.optimal_dtype(vocab_size)``.
        num_workers: tokeniser threads (default: all cores).
        default_domain: for records without ``meta.pile_set_name`` (None: an error).

    Returns:
        :class:`TokenizeStats`; a ReproError (nothing written) for a missing shard or no documents.
    """
    if not inputs:
        raise ReproError("no input shards given")
    for p in inputs:  # fail before hours of tokenising, not when the reader reaches the missing shard
        if not Path(p).is_file():
            raise ReproError(f"{p}: no such file")
    records = iter_pile_documents(inputs, default_domain=default_domain, progress=progress)
    prefix = str(out_prefix)
    check_indexed_output(prefix)
    tmp_dir, created = make_temp_dir(prefix)
    tmp_prefix = str(tmp_dir / Path(prefix).name)
    t0 = time.perf_counter()
    builder: IndexedDatasetBuilder | None = None
    try:
        domains: dict[str, int] = {}  # name -> index, in order of first appearance
        doc_domain: list[int] = []
        pending: deque[str] = deque()  # domains of the documents handed to the tokenizer and not back yet
        docs: Counter[str] = Counter()
        toks: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()

        def texts() -> Iterator[str]:
            for text, domain in records:
                doc_domain.append(domains.setdefault(domain, len(domains)))
                pending.append(domain)
                docs[domain] += 1
                nbytes[domain] += len(text.encode("utf-8"))
                yield text

        builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
        with tqdm(unit="doc", desc=f"tokenize {Path(prefix).name}", disable=not progress) as bar:
            for ids in encode_documents(tokenizer, texts(), num_workers=num_workers):
                builder.add_document(ids, [ids.size])
                toks[pending.popleft()] += int(ids.size)  # output order = input order
                bar.update(1)
        n_docs, n_tokens = len(doc_domain), sum(toks.values())
        if n_docs == 0:
            raise ReproError(f"{', '.join(str(p) for p in inputs)}: empty corpus, no documents to tokenise")
        builder.finalize(tmp_prefix + ".idx")

        write_domain_sidecar(tmp_prefix, list(domains), doc_domain, num_tokens=n_tokens, documents=docs, tokens=toks,
                             bytes=nbytes, tokenizer=dict(tokenizer.unique_identifiers))
        check_indexed_output(prefix)  # again: tokenising may have taken hours
        for tmp_file, final in zip(prefix_files(tmp_prefix), prefix_files(prefix)):
            os.replace(tmp_file, final)
        created = []  # the output exists now: its directories stay
    except (OSError, RuntimeError) as exc:
        # a full disk while writing .bin, a read-only directory: one line naming the prefix
        error = error_from_os_error(exc, prefix, tmp_dir)
        if error is None:
            raise
        raise error from None
    finally:
        if builder is not None:
            builder.data_file.close()  # already closed by finalize() on success; closing twice is harmless
        shutil.rmtree(tmp_dir, ignore_errors=True)
        remove_empty_dirs(created)  # directories made for an output that was not written
    return TokenizeStats(prefix, n_docs, n_tokens, time.perf_counter() - t0, docs, toks, nbytes)


@dataclass(frozen=True)
class DomainIndex:
    """The domain of every document of one indexed dataset: ``doc_domain`` ``[num_documents]`` indexes ``names``;
    ``meta``: the whole ``.domains.json``."""

    prefix: str
    names: tuple[str, ...]
    doc_domain: np.ndarray
    meta: dict

    def domain_of(self, document: int) -> str:
        return self.names[int(self.doc_domain[document])]


def load_domain_index(prefix: str | os.PathLike) -> DomainIndex:
    """Read the domain sidecar of an indexed dataset (a ReproError when it is missing or does not match)."""
    prefix = str(prefix)
    meta_path, npy_path = prefix + DOMAINS_JSON, prefix + DOMAINS_NPY
    for p in (meta_path, npy_path):
        if not os.path.isfile(p):
            raise ReproError(f"{p}: no such file (domain sidecar of indexed dataset {prefix})")
    try:
        meta = json.loads(Path(meta_path).read_text())
        names = tuple(meta["domains"])
        doc_domain = np.load(npy_path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReproError(f"{meta_path}: unreadable domain sidecar ({exc})") from None
    if doc_domain.ndim != 1 or doc_domain.shape[0] != meta.get("num_documents"):
        raise ReproError(f"{npy_path}: domain array does not match {meta_path}")
    return DomainIndex(prefix, names, doc_domain, meta)


def existing_prefixes(prefixes: Sequence[str | os.PathLike], what: str = "") -> list[str]:
    """``prefixes`` as strings; a ReproError (``what`` its first words) for none, or for a missing dataset."""
    sources = [str(p) for p in prefixes]
    if not sources:
        raise ReproError(f"{what}no indexed dataset given")
    for prefix in sources:
        if not IndexedDataset.exists(prefix):
            raise ReproError(f"{prefix}.idx / {prefix}.bin: no such indexed dataset")
    return sources


def read_documents(prefix: str | os.PathLike) -> Iterator[np.ndarray]:
    """Yield every document's token ids (EOD included) from an indexed dataset, in order."""
    ds = IndexedDataset(existing_prefixes([prefix])[0])
    for i in range(len(ds)):
        # a copy: megatron closes the mmap when ``ds`` goes away, which would invalidate a view
        yield np.array(ds[i])
