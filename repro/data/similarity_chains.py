"""How similarity batching orders documents (In-Context Pretraining, Shi et al. 2024, Algorithm 1):
document vectors, nearest neighbours, the greedy path over the neighbour graph, and its cut into chains.

These are steps 1 and 2 of :mod:`repro.data.similarity`'s docstring and the chains of its step 3, with its
deviations 1, 2 and 4 (TF-IDF + SVD vectors instead of Contriever; FAISS exact or IVF search; the
undirected graph and its seeded tie-breaks), and the options they take (:class:`SimilarityBatchingConfig`).
The functions read documents and return arrays; the cache, the split and the derived dataset's files are
:mod:`repro.data.similarity`'s, which re-exports these names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

#: megatron's index stores sequence lengths as int32.
MAX_SEQUENCE_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class SimilarityBatchingConfig:
    """Options of similarity batching (every field is part of the cache key).

    Args:
        num_neighbors: k, the nearest neighbours retrieved per document.
        embedding_dim: dimensions of the TF-IDF + truncated-SVD document vectors.
        max_chain_tokens: a chain (one derived sequence) ends before it would exceed this many tokens; a
            single longer document stays a chain of its own.
        svd_fit_documents: documents (a seeded sample) the TF-IDF weights and the SVD are fitted on.
        exact_search_max_documents: exact FAISS search up to this many documents, IVF above.
        seed: seeds the SVD, the fitting sample, the minimum-degree tie-breaks and the chain order.
    """

    num_neighbors: int = 10
    embedding_dim: int = 128
    max_chain_tokens: int = 1 << 16
    svd_fit_documents: int = 100_000
    exact_search_max_documents: int = 200_000
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("num_neighbors", "embedding_dim", "max_chain_tokens", "svd_fit_documents",
                     "exact_search_max_documents"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_chain_tokens > MAX_SEQUENCE_TOKENS:
            raise ValueError(f"max_chain_tokens must be <= {MAX_SEQUENCE_TOKENS} (megatron's int32 lengths)")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


# --------------------------------------------------------------------------------------- representation
def _count_matrix(dataset: IndexedDataset, documents: np.ndarray, vocab_size: int, eod: int | None):
    """Sparse ``[N, V]`` token-count matrix of the given documents (EOD excluded)."""
    from scipy.sparse import csr_matrix

    indptr = np.zeros(len(documents) + 1, dtype=np.int64)
    cols, vals = [], []
    for i, doc in enumerate(documents):
        tokens = np.asarray(dataset[int(doc)], dtype=np.int64)
        if eod is not None:
            tokens = tokens[tokens != eod]
        ids, counts = np.unique(tokens, return_counts=True)
        cols.append(ids)
        vals.append(counts)
        indptr[i + 1] = indptr[i] + ids.size
    data = np.concatenate(vals).astype(np.float32) if vals else np.zeros(0, np.float32)
    index = np.concatenate(cols) if cols else np.zeros(0, np.int64)
    return csr_matrix((data, index, indptr), shape=(len(documents), vocab_size))


def document_embeddings(
    datasets: Sequence[IndexedDataset],
    documents: np.ndarray,
    vocab_size: int,
    eod: int | None,
    config: SimilarityBatchingConfig,
    chunk: int = 20_000,
) -> np.ndarray:
    """L2-normalised TF-IDF + truncated-SVD vectors of documents (deviation 1 of :mod:`repro.data.similarity`).

    Args:
        datasets: the source indexed datasets.
        documents: ``[N, 2]`` ``(source index, document id)`` rows.
        vocab_size: columns of the count matrix (every token id must be below it).
        eod: the end-of-document id, left out of the counts (it is in every document); None keeps all ids.
        config: the options (``embedding_dim``, ``svd_fit_documents``, ``seed``).
        chunk: documents transformed at a time (bounds the memory of the sparse matrices).

    Returns:
        ``[N, d]`` float32 with unit rows (rows of documents without any token are zero),
        ``d = min(embedding_dim, ids present in the fitting sample - 1, fit documents - 1)``.
    """
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.preprocessing import normalize

    N = len(documents)
    rng = np.random.default_rng(config.seed)
    fit_rows = np.sort(rng.permutation(N)[: config.svd_fit_documents])

    def counts(rows: np.ndarray):
        from scipy.sparse import vstack

        parts = [
            _count_matrix(datasets[s], documents[rows][documents[rows, 0] == s, 1], vocab_size, eod)
            for s in range(len(datasets))
        ]
        # Rows come back grouped by source; restore the requested order.
        order = np.argsort(documents[rows, 0], kind="stable")
        stacked = vstack(parts).tocsr()
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return stacked[inverse]

    # Only the ids present in the fitting sample: the SVD's components are zero on the others, and the
    # TF-IDF row norm they would change cancels in the final normalisation (the projection is linear).
    fit_counts = counts(fit_rows)
    used = np.flatnonzero(fit_counts.getnnz(axis=0))
    fit_counts = fit_counts[:, used]
    tfidf = TfidfTransformer(sublinear_tf=True).fit(fit_counts)
    dim = max(1, min(config.embedding_dim, used.size - 1, len(fit_rows) - 1))
    svd = TruncatedSVD(n_components=dim, random_state=config.seed).fit(tfidf.transform(fit_counts))
    out = np.empty((N, dim), dtype=np.float32)
    for start in range(0, N, chunk):
        rows = np.arange(start, min(N, start + chunk))
        out[rows] = svd.transform(tfidf.transform(counts(rows)[:, used])).astype(np.float32)
    return normalize(out, norm="l2").astype(np.float32)


# ------------------------------------------------------------------------------------- neighbour search
def nearest_neighbors(
    embeddings: np.ndarray, k: int, config: SimilarityBatchingConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Each document's top-k neighbours by inner product (cosine on unit vectors), itself excluded.

    Args:
        embeddings: ``[N, d]`` float32 unit rows.
        k: neighbours per document (at most N - 1 are returned).
        config: ``exact_search_max_documents`` and ``seed`` (the IVF training sample).

    Returns:
        ``(ids [N, k'], sims [N, k'])``, most similar first, ``k' = min(k, N - 1)``; -1 ids where the
        approximate search found fewer.
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
    ids = ids[keep].reshape(N, k_eff)
    sims = sims[keep].reshape(N, k_eff)
    return ids.astype(np.int64), sims.astype(np.float32)


# ---------------------------------------------------------------------------------------- graph traversal
def greedy_path(ids: np.ndarray, sims: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """ICLM's greedy maximum-travelling-salesman path over the kNN graph (Shi et al. 2024, Algorithm 1).

    The graph is undirected: i and j are joined when either is among the other's neighbours, weighted by
    their similarity. Start at an unvisited document of minimum degree (ties in a seeded random order),
    move to the unvisited neighbour of highest weight while there is one, otherwise jump to the next
    unvisited minimum-degree document.

    Args:
        ids: ``[N, k]`` neighbour ids (-1 for none).
        sims: ``[N, k]`` their similarities.
        seed: seeds the tie-break among documents of equal degree.

    Returns:
        ``(order [N], linked [N])``: every document once, in path order, and whether each was reached
        from its predecessor along an edge (False for the first and after every jump).
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


def chains_from_path(
    path: np.ndarray, linked: np.ndarray, lengths: np.ndarray, max_chain_tokens: int
) -> list[np.ndarray]:
    """Cut the path into chains: at every jump, and before a chain would exceed ``max_chain_tokens``.

    Args:
        path: ``[N]`` document indices in path order.
        linked: ``[N]`` whether each step followed an edge.
        lengths: ``[N]`` tokens of each document (indexed like ``path``'s values).
        max_chain_tokens: the largest chain (a longer single document is a chain of its own).

    Returns:
        The chains, each an array of document indices in path order.
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
