"""Similarity-based data batching (Lory, Sec. 3.2 and Appendix C): similar documents in the same sequences.

The design: docs/routers.md, "Lory's similarity batching" (after In-Context Pretraining, Shi et al., ICLR 2024,
Alg. 1); chains of documents keep their EOD and are written in seeded order.

Deviations: (1) TF-IDF over token ids (sublinear, no EOD) + truncated SVD, L2-normalised, not Contriever (not
downloadable; lexical similarity); (2) FAISS exact inner product up to ``exact_search_max_documents``, else IVF
(``4 sqrt(N)`` lists, ``nprobe`` 32); (3) no semantic dedup; (4) undirected edge if either is in the other's kNN,
cosine-weighted; min-degree ties seeded-random. Cached as ``<first prefix>.simbatch-<input hash>``; foreign files
of that name are never overwritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from repro.data.datasets import DEFAULT_SPLIT, split_ranges
from repro.data.indexed import (
    dataset_fingerprint,
    existing_prefixes,
    load_domain_index,
    prefix_files,
    write_domain_sidecar,
)
from repro.data.token_counts import count_tokens
from repro.errors import ReproError
from repro.io_utils import make_temp_dir, read_json
from repro.schema import check_minimums

FORMAT = 1
#: Suffixes of the files of a derived dataset besides ``.bin``/``.idx``; sequence ``i``'s source documents are
#: the chains file's ``members[offsets[i]:offsets[i + 1]]`` (``(source, document)`` rows, ``lengths`` tokens each).
CHAINS_NPZ = ".chains.npz"
MANIFEST_JSON = ".simbatch.json"
#: megatron's index stores sequence lengths as int32.
MAX_SEQUENCE_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class SimilarityBatchingConfig:
    """Options of similarity batching (every field is part of the cache key).

    Args:
        num_neighbors: k nearest neighbours per document.
        embedding_dim: dimensions of the TF-IDF + SVD vectors.
        max_chain_tokens: chain token cap (a longer single document is a chain of its own).
        svd_fit_documents: size of the seeded sample TF-IDF and SVD are fitted on.
        exact_search_max_documents: exact FAISS search up to this many documents, IVF above.
        seed: seeds the SVD, the fitting sample, the min-degree tie-breaks and the chain order.
    """

    num_neighbors: int = 10
    embedding_dim: int = 128
    max_chain_tokens: int = 1 << 16
    svd_fit_documents: int = 100_000
    exact_search_max_documents: int = 200_000
    seed: int = 1234

    def __post_init__(self) -> None:
        check_minimums(self, num_neighbors=1, embedding_dim=1, max_chain_tokens=1, svd_fit_documents=1,
                       exact_search_max_documents=1)
        if self.max_chain_tokens > MAX_SEQUENCE_TOKENS:
            raise ValueError(f"max_chain_tokens must be <= {MAX_SEQUENCE_TOKENS} (megatron's int32 lengths)")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


@dataclass(frozen=True)
class SimilarityBatched:
    """A derived, similarity-batched indexed dataset (what :func:`build_similarity_dataset` returns).

    Attributes:
        prefix: derived prefix, for :func:`repro.data.datasets.build_datasets`.
        split: its split (chains train; the sources' valid/test documents).
        num_chains: training sequences.
        stats: see :func:`build_similarity_dataset`.
    """

    prefix: str
    split: str
    num_chains: int
    stats: dict
    reused: bool


def document_embeddings(datasets: Sequence[IndexedDataset], documents: np.ndarray, vocab_size: int, eod: int | None,
                        config: SimilarityBatchingConfig) -> np.ndarray:
    """L2-normalised TF-IDF + truncated-SVD vectors of documents (deviation 1).

    Args:
        documents: ``[N, 2]`` ``(source index, document id)`` rows.
        vocab_size: count-matrix columns (> every token id).
        eod: end-of-document id left out of the counts; None keeps all ids.
        config: ``embedding_dim``, ``svd_fit_documents`` and ``seed``.

    Returns:
        ``[N, d]`` float32 unit rows (empty documents: 0), ``d = min(embedding_dim, fit ids - 1, fit docs - 1)``.
    """
    from scipy.sparse import csr_matrix
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.preprocessing import normalize

    N = len(documents)
    rng = np.random.default_rng(config.seed)
    fit_rows = np.sort(rng.permutation(N)[: config.svd_fit_documents])

    def counts(rows: np.ndarray):  # sparse ``[n, V]`` token counts of ``documents[rows]`` (EOD excluded)
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        cols, vals = [], []
        for i, (source, doc) in enumerate(documents[rows]):
            tokens = np.asarray(datasets[source][int(doc)], dtype=np.int64)
            if eod is not None:
                tokens = tokens[tokens != eod]
            ids, n = np.unique(tokens, return_counts=True)
            cols.append(ids)
            vals.append(n)
            indptr[i + 1] = indptr[i] + ids.size
        data = np.concatenate(vals).astype(np.float32) if vals else np.zeros(0, np.float32)
        index = np.concatenate(cols) if cols else np.zeros(0, np.int64)
        return csr_matrix((data, index, indptr), shape=(len(rows), vocab_size))

    # Fit-sample ids only: SVD components are zero elsewhere and the row norm cancels in the final normalisation.
    fit_counts = counts(fit_rows)
    used = np.flatnonzero(fit_counts.getnnz(axis=0))
    fit_counts = fit_counts[:, used]
    tfidf = TfidfTransformer(sublinear_tf=True).fit(fit_counts)
    dim = max(1, min(config.embedding_dim, used.size - 1, len(fit_rows) - 1))
    svd = TruncatedSVD(n_components=dim, random_state=config.seed).fit(tfidf.transform(fit_counts))
    out = np.empty((N, dim), dtype=np.float32)
    for start in range(0, N, 20_000):  # a chunk at a time bounds the sparse memory
        rows = np.arange(start, min(N, start + 20_000))
        out[rows] = svd.transform(tfidf.transform(counts(rows)[:, used])).astype(np.float32)
    return normalize(out, norm="l2").astype(np.float32)


def nearest_neighbors(embeddings: np.ndarray, k: int,
                      config: SimilarityBatchingConfig) -> tuple[np.ndarray, np.ndarray]:
    """Each document's top-k neighbours by inner product (cosine on unit vectors), itself excluded.

    Args:
        embeddings: ``[N, d]`` float32 unit rows.
        k: neighbours per document.
        config: ``exact_search_max_documents`` and ``seed`` (IVF training sample).

    Returns:
        ``(ids [N, k'], sims [N, k'])``, most similar first, ``k' = min(k, N - 1)``; -1 ids where IVF found fewer.
    """
    import faiss

    N, d = embeddings.shape
    k_eff = min(k, N - 1)
    if k_eff < 1:
        return np.zeros((N, 0), np.int64), np.zeros((N, 0), np.float32)
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    if N <= config.exact_search_max_documents:
        index = faiss.IndexFlatIP(d)
    else:
        nlist = int(4 * math.sqrt(N))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        sample = np.random.default_rng(config.seed).permutation(N)[: max(40 * nlist, 10_000)]
        index.train(x[np.sort(sample)])
        index.nprobe = 32
    index.add(x)
    sims, ids = index.search(x, k_eff + 1)
    # Drop each document itself (not necessarily in column 0 when duplicates tie).
    own = ids == np.arange(N)[:, None]
    keep = ~own
    keep[own.sum(1) == 0, -1] = False  # itself not returned: drop the least similar instead
    return ids[keep].reshape(N, k_eff).astype(np.int64), sims[keep].reshape(N, k_eff).astype(np.float32)


def greedy_path(ids: np.ndarray, sims: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """ICLM's greedy max-TSP path over the kNN graph (Shi et al. 2024, Alg. 1): from an unvisited min-degree
    document (deviation 4) to the heaviest unvisited neighbour while there is one, else jump.

    Args:
        ids: ``[N, k]`` neighbour ids (-1 for none).
        sims: ``[N, k]`` their similarities.
        seed: seeds the tie-break among equal degrees.

    Returns:
        ``(order [N], linked [N])``: path order, and whether each step followed an edge (False after a jump).
    """
    N = ids.shape[0]
    src = np.repeat(np.arange(N, dtype=np.int64), ids.shape[1])
    dst = ids.reshape(-1).astype(np.int64)
    w = sims.reshape(-1)
    valid = (dst >= 0) & (dst != src)
    src, dst, w = src[valid], dst[valid], w[valid]
    # Both directions, one edge per unordered pair (the larger weight if both lists hold it).
    a, b = np.concatenate([src, dst]), np.concatenate([dst, src])
    ww = np.concatenate([w, w])
    order = np.lexsort((-ww, b, a))
    a, b, ww = a[order], b[order], ww[order]
    first = np.ones(a.size, dtype=bool)
    first[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    a, b, ww = a[first], b[first], ww[first]
    # Within each row, neighbours by decreasing weight.
    order = np.lexsort((-ww, a))
    a, b = a[order], b[order]
    degree = np.bincount(a, minlength=N)
    indptr = np.concatenate([[0], np.cumsum(degree)])
    cursor = indptr[:-1].copy()

    rng = np.random.default_rng(seed)
    start_order = np.lexsort((rng.permutation(N), degree))  # minimum degree first, random ties
    visited = np.zeros(N, dtype=bool)
    path = np.empty(N, dtype=np.int64)
    linked = np.zeros(N, dtype=bool)
    n, next_start = 0, 0
    while n < N:
        while visited[start_order[next_start]]:
            next_start += 1
        current = int(start_order[next_start])
        visited[current] = True
        path[n], n = current, n + 1
        while True:
            row_end = indptr[current + 1]
            c = cursor[current]
            while c < row_end and visited[b[c]]:
                c += 1
            cursor[current] = c
            if c == row_end:
                break
            current = int(b[c])
            visited[current] = True
            path[n], linked[n], n = current, True, n + 1
    return path, linked


def chains_from_path(path: np.ndarray, linked: np.ndarray, lengths: np.ndarray,
                     max_chain_tokens: int) -> list[np.ndarray]:
    """Cut the path into chains: at every jump, and before a chain would exceed ``max_chain_tokens``.

    Args:
        path: ``[N]`` document indices in path order.
        linked: ``[N]`` whether each step followed an edge.
        lengths: ``[N]`` tokens per document (indexed by ``path``'s values).
        max_chain_tokens: chain token cap (a longer single document is a chain of its own).

    Returns:
        The chains, arrays of document indices in path order.
    """
    chains: list[np.ndarray] = []
    start, tokens = 0, 0
    for i in range(len(path)):
        length = int(lengths[path[i]])
        if i > start and (not linked[i] or tokens + length > max_chain_tokens):
            chains.append(path[start:i])
            start, tokens = i, 0
        tokens += length
    if len(path):
        chains.append(path[start:])
    return chains


def _derived_files(prefix: str) -> list[str]:
    # .idx then the manifest last: the manifest vouches for a complete dataset.
    return [prefix + CHAINS_NPZ, *prefix_files(prefix), prefix + MANIFEST_JSON]


def build_similarity_dataset(prefixes: Sequence[str | os.PathLike], split: str = DEFAULT_SPLIT,
                             config: SimilarityBatchingConfig | None = None, *, eod: int | None = None,
                             log=None) -> SimilarityBatched:
    """Build (or reuse) the similarity-batched derived dataset of ``prefixes``.

    Args:
        prefixes: source prefixes (from :mod:`repro.data.indexed`, with domain sidecar); output goes beside the first.
        split: the run's megatron ``split`` of the sources; chains come from the training part only.
        config: options (default :class:`SimilarityBatchingConfig()`).
        eod: end-of-document id left out of the representation; default: the first document's last token.
        log: called with one line per stage (e.g. ``print``); default silent.

    Returns:
        :class:`SimilarityBatched`; ``stats``: ``documents``, ``chains``, ``mean_chain_tokens``, ``linked_fraction``,
        ``{adjacent,random}_similarity`` and ``same_domain_{adjacent,random}`` (chain neighbours vs random pairs).

    Raises:
        ReproError: missing source, empty training split, or foreign files at the derived name.
    """
    cfg = config or SimilarityBatchingConfig()
    say = log or (lambda _msg: None)
    sources = existing_prefixes(prefixes, "similarity batching: ")
    domains = [load_domain_index(p) for p in sources]  # a missing sidecar: one line before any work
    try:
        split_ranges(1, split)
    except Exception as exc:  # megatron asserts on a malformed split
        raise ReproError(f"similarity batching: bad split '{split}' ({exc or type(exc).__name__})") from None
    inputs = {"format": FORMAT, "sources": [dataset_fingerprint(p) for p in sources], "split": split,
              "config": dataclasses.asdict(cfg), "vocab_size": None, "eod": eod}  # None keeps earlier cache keys
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    out_prefix = f"{sources[0]}.simbatch-{key[:16]}"
    with open(Path(out_prefix).parent / f".{Path(out_prefix).name}.lock", "w") as lock:
        # Ranks of one run may call this at once: one builds, the others wait and reuse (closing unlocks).
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = read_json(out_prefix + MANIFEST_JSON)
        complete = all(os.path.isfile(p) for p in _derived_files(out_prefix))
        reused = manifest is not None and manifest.get("key") == key and complete
        if reused:
            say(f"similarity batching: reused {out_prefix}")
        else:
            ours = manifest is not None and manifest.get("format") == FORMAT and "key" in manifest
            present = [p for p in _derived_files(out_prefix) if os.path.exists(p)]
            if present and not ours:
                raise ReproError(f"{present[0]}: exists but was not written by similarity batching; "
                                 "move it away (it is not overwritten)")
            manifest = _build(sources, domains, split, cfg, key, out_prefix, eod, say)
        return SimilarityBatched(out_prefix, manifest["derived_split"], int(manifest["num_chains"]),
                                 dict(manifest["stats"]), reused)


def _build(sources, domains, split, cfg, key, out_prefix, eod, say) -> dict:
    t0 = time.perf_counter()
    datasets = [IndexedDataset(p) for p in sources]
    train, valid, test = _documents_by_split(datasets, sources, split)
    lengths = np.array([int(datasets[s].sequence_lengths[d]) for s, d in train], dtype=np.int64)

    # count-matrix id bound: a small index dtype's range, else the largest id + 1
    vocab_size = max(int(np.iinfo(ds.index.dtype).max) + 1 if np.dtype(ds.index.dtype).itemsize <= 2
                     else count_tokens([prefix], "1,0,0").size for prefix, ds in zip(sources, datasets))
    if eod is None:
        eod = int(datasets[0][0][-1])

    say(f"similarity batching: {len(train)} training documents, TF-IDF + SVD ({cfg.embedding_dim} dims)")
    emb = document_embeddings(datasets, train, vocab_size, eod, cfg)
    say(f"similarity batching: {cfg.num_neighbors} nearest neighbours (faiss)")
    ids, sims = nearest_neighbors(emb, cfg.num_neighbors, cfg)
    path, linked = greedy_path(ids, sims, cfg.seed)
    chains = chains_from_path(path, linked, lengths, cfg.max_chain_tokens)
    rng = np.random.default_rng(cfg.seed + 1)
    chains = [chains[i] for i in rng.permutation(len(chains))]  # megatron's split must not see path order
    stats = _chain_stats(chains, linked, lengths, emb, train, domains, rng)

    tmp_dir, _ = make_temp_dir(out_prefix)  # beside the sources: no parent to make
    tmp = str(tmp_dir / Path(out_prefix).name)
    try:
        sequences = [train[chain] for chain in chains] + [row[None] for row in np.concatenate([valid, test])]
        names, seq_domain = _write_sequences(tmp, datasets, domains, sequences)
        write_domain_sidecar(tmp, names, seq_domain, similarity_batched_from=sources,
                             tokenizer=domains[0].meta.get("tokenizer", {}))
        stats["seconds"] = time.perf_counter() - t0
        manifest = {"format": FORMAT, "key": key, "sources": sources, "split": split,
                    "derived_split": f"{len(chains)},{len(valid)},{len(test)}", "num_chains": len(chains),
                    "config": dataclasses.asdict(cfg), "vocab_size": vocab_size, "eod": eod, "stats": stats}
        Path(tmp + MANIFEST_JSON).write_text(json.dumps(manifest, indent=2))
        for tmp_file, final in zip(_derived_files(tmp), _derived_files(out_prefix)):
            os.replace(tmp_file, final)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        del datasets
    say(f"similarity batching: {stats['chains']} chains of {stats['documents']} documents, adjacent cosine "
        f"{stats['adjacent_similarity']:.3f} vs random {stats['random_similarity']:.3f} "
        f"({stats['seconds']:.1f} s) -> {out_prefix}")
    return manifest


def _documents_by_split(datasets: Sequence[IndexedDataset], sources: Sequence[str],
                        split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sources' training, validation and test documents (``[n, 2]`` ``(source, document)`` rows each)."""
    parts: tuple[list[np.ndarray], ...] = ([], [], [])
    for s, ds in enumerate(datasets):
        for bucket, bounds in zip(parts, split_ranges(len(ds), split)):
            if bounds is not None and bounds[1] > bounds[0]:
                ids = np.arange(bounds[0], bounds[1], dtype=np.int64)
                bucket.append(np.stack([np.full_like(ids, s), ids], axis=1))
    if not parts[0]:
        raise ReproError(f"similarity batching: split '{split}' leaves no training document in {', '.join(sources)}")
    return tuple(np.concatenate(p) if p else np.zeros((0, 2), np.int64) for p in parts)  # type: ignore[return-value]


def _chain_stats(chains, linked, lengths, emb, train, domains, rng: np.random.Generator) -> dict:
    """The ``stats`` of :func:`build_similarity_dataset` but ``seconds``: chain neighbours against random pairs."""
    pairs = np.array([(c[i], c[i + 1]) for c in chains for i in range(len(c) - 1)], dtype=np.int64).reshape(-1, 2)
    rand = rng.integers(0, len(train), size=(max(1, min(100_000, len(pairs) or 1000)), 2))
    dom_name = np.array([domains[s].domain_of(int(d)) for s, d in train])

    def mean_sim(p):  # cosine: the rows are unit vectors
        return float(np.mean(np.sum(emb[p[:, 0]] * emb[p[:, 1]], axis=1))) if len(p) else float("nan")

    def same_domain(p):
        return float(np.mean(dom_name[p[:, 0]] == dom_name[p[:, 1]])) if len(p) else float("nan")

    return {"documents": int(len(train)), "chains": len(chains),
            "mean_chain_tokens": float(np.mean([lengths[c].sum() for c in chains])),
            "linked_fraction": float(linked[1:].mean()) if len(linked) > 1 else 0.0,
            "adjacent_similarity": mean_sim(pairs), "random_similarity": mean_sim(rand),
            "same_domain_adjacent": same_domain(pairs), "same_domain_random": same_domain(rand)}


def _write_sequences(tmp, datasets, domains, sequences) -> tuple[list[str], list[int]]:
    """Write each sequence's ``(source, document)`` rows concatenated (``tmp.bin``/``.idx``) and :data:`CHAINS_NPZ`.

    Returns:
        ``(domain names, domain id of each sequence)`` for the domain sidecar.
    """
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=datasets[0].index.dtype)
    try:
        names: dict[str, int] = {}  # name -> index, in order of first appearance
        seq_domain: list[int] = []
        offsets, member_lengths = [0], []
        for rows in sequences:
            docs = [np.asarray(datasets[s][int(d)]) for s, d in rows]
            tokens = np.concatenate(docs)
            builder.add_document(tokens, [tokens.size])
            # Sidecar domain: the one with most tokens (per-document domains are in the chains file).
            by_domain: dict[str, int] = {}
            for (s, d), doc in zip(rows, docs):
                name = domains[s].domain_of(int(d))
                by_domain[name] = by_domain.get(name, 0) + doc.size
            seq_domain.append(names.setdefault(max(by_domain, key=by_domain.get), len(names)))
            member_lengths.append(np.array([doc.size for doc in docs], dtype=np.int64))
            offsets.append(offsets[-1] + len(rows))
        builder.finalize(tmp + ".idx")
    finally:
        builder.data_file.close()
    np.savez(tmp + CHAINS_NPZ, offsets=np.asarray(offsets, dtype=np.int64),
             members=np.concatenate(sequences).astype(np.int64),
             lengths=np.concatenate(member_lengths).astype(np.int64))
    return list(names), seq_domain


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m repro.data.similarity PREFIX [PREFIX...] [--split S]``: build the derived dataset once."""
    parser = argparse.ArgumentParser(prog="python -m repro.data.similarity", description=__doc__.split("\n")[0])
    parser.add_argument("prefixes", nargs="+", help="indexed-dataset prefixes (with their domain sidecars)")
    parser.add_argument("--split", default=DEFAULT_SPLIT, help="the run's train/valid/test split")
    fields = dataclasses.fields(SimilarityBatchingConfig)
    for field in fields:
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    args = parser.parse_args(argv)
    try:
        cfg = SimilarityBatchingConfig(**{f.name: getattr(args, f.name) for f in fields})
        result = build_similarity_dataset(args.prefixes, args.split, cfg, log=print)
    except (ReproError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"prefix": result.prefix, "split": result.split, **result.stats}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
