"""Lory's similarity-based batching (repro/data/similarity.py) and the training-token counts (token_counts.py)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset

from repro.data import similarity
from repro.data.datasets import build_datasets
from repro.data.indexed import load_domain_index, read_documents
from repro.data.minipile import MiniPileConfig, build_mini_pile
from repro.data.similarity import (
    SimilarityBatchingConfig,
    build_similarity_dataset,
    chains_from_path,
    greedy_path,
    nearest_neighbors,
    split_ranges,
)
from repro.data.token_counts import count_tokens, token_counts_file
from repro.errors import ReproError

# Small documents, so the corpus has a few hundred of them and chains of several documents.
SMALL = MiniPileConfig(max_bytes_per_domain=60_000, max_doc_bytes=6_000, vocab_size=1024)
SPLIT = "90,8,2"
CFG = SimilarityBatchingConfig(num_neighbors=5, embedding_dim=48, max_chain_tokens=4096)
SEQ = 64


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    return build_mini_pile(tmp_path_factory.mktemp("minipile"), SMALL, num_workers=2)


@pytest.fixture(scope="module")
def batched(mini):
    return build_similarity_dataset([mini.train_prefix], SPLIT, CFG)


def _load_chains(prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with np.load(prefix + similarity.CHAINS_NPZ, allow_pickle=False) as z:
        return z["offsets"], z["members"], z["lengths"]


def _chain_members(prefix: str, chain: int) -> list[tuple[int, int]]:
    """``[(source index, document id), ...]`` of one chain, in order."""
    offsets, members, _ = _load_chains(prefix)
    return [tuple(int(v) for v in m) for m in members[offsets[chain] : offsets[chain + 1]]]


def _token_sources(prefix: str, sequence: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """``[n, 2]`` ``(source index, document id)`` of positions of derived sequences (-1 for padding)."""
    offsets, members, lengths = _load_chains(prefix)
    out = np.full((len(sequence), 2), -1, dtype=np.int64)
    for i, (seq, off) in enumerate(zip(np.asarray(sequence), np.asarray(offset))):
        if seq < 0:
            continue
        lo, hi = offsets[seq], offsets[seq + 1]
        ends = np.cumsum(lengths[lo:hi])
        out[i] = members[lo + int(np.searchsorted(ends, off, side="right"))]
    return out


def _sample_token_documents(dataset, idx: int) -> tuple[str, np.ndarray, np.ndarray]:
    """Source of every input token of sample ``idx`` (shuffle index -> sample index -> document index).

    Returns:
        ``(prefix, doc [S], offset [S])`` (-1: padding), ``IndexedDataset(prefix)[doc[i]][offset[i]] == tokens[i]``.
    """
    if isinstance(dataset, BlendedDataset):
        sub = dataset.datasets[int(dataset.dataset_index[idx])]
        return _sample_token_documents(sub, int(dataset.dataset_sample_index[idx]))
    cfg = dataset.config
    extra = int(cfg.add_extra_token_to_sequence)
    j = int(dataset.shuffle_index[idx])
    beg, beg_off = (int(v) for v in dataset.sample_index[j])
    end, end_off = (int(v) for v in dataset.sample_index[j + 1])
    lengths = dataset.dataset.sequence_lengths
    docs, offsets = [], []
    for k in range(beg, end + 1):
        doc = int(dataset.document_index[k])
        start = beg_off if k == beg else 0
        stop = int(lengths[doc]) if k < end else end_off + extra
        docs.append(np.full(stop - start, doc, dtype=np.int64))
        offsets.append(np.arange(start, stop, dtype=np.int64))
    doc_ids, offs = np.concatenate(docs), np.concatenate(offsets)
    total = cfg.sequence_length + extra
    if doc_ids.size < total:  # megatron pads a short last sample
        pad = np.full(total - doc_ids.size, -1, dtype=np.int64)
        doc_ids, offs = np.concatenate([doc_ids, pad]), np.concatenate([offs, pad])
    return dataset.dataset_path, doc_ids[: cfg.sequence_length], offs[: cfg.sequence_length]


# ---- the pieces, against hand-worked answers ----------------------------------------------------------------


def test_split_ranges_are_megatrons(mini, tmp_path):
    tok = mini.tokenizer()
    train, valid, test = build_datasets([mini.train_prefix], SEQ, (10, 4, 2), 1, tmp_path, tok, split=SPLIT)
    n = len(list(read_documents(mini.train_prefix)))
    ranges = split_ranges(n, SPLIT)
    for ds, (beg, end) in zip((train, valid, test), ranges):
        assert np.array_equal(ds.indices, np.arange(beg, end))
    assert split_ranges(100, "1,0,0") == [(0, 100), None, None]


def test_greedy_path_follows_iclm_algorithm_on_a_hand_graph():
    # Undirected edges: 0-1 .9, 0-2 .5, 1-2 .8, 3-4 .7, 0-3 .1, 3-5 .2, 2-5 .3; document 6 has none.
    # Degrees 0:3 1:2 2:3 3:3 4:1 5:2 6:0 -> start at 6 (isolated), jump to 4 (degree 1), then always the
    # most similar unvisited neighbour: 4 -> 3 (.7) -> 5 (.2 beats .1) -> 2 (.3) -> 1 (.8) -> 0 (.9).
    ids = np.array([[1, 2], [0, 2], [1, 0], [4, 0], [3, -1], [3, 2], [-1, -1]])
    sims = np.array([[0.9, 0.5], [0.9, 0.8], [0.8, 0.5], [0.7, 0.1], [0.7, 0], [0.2, 0.3], [0, 0]], np.float32)
    path, linked = greedy_path(ids, sims, seed=0)
    assert path.tolist() == [6, 4, 3, 5, 2, 1, 0]
    assert linked.tolist() == [False, False, True, True, True, True, True]


def test_greedy_path_visits_every_document_once_and_breaks_degree_ties_by_seed():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=(50, 4))
    sims = rng.random((50, 4)).astype(np.float32)
    path, linked = greedy_path(ids, sims, 0)
    assert sorted(path.tolist()) == list(range(50)) and not linked[0]
    assert np.array_equal(path, greedy_path(ids, sims, 0)[0])
    # A ring: every document has degree 2, so the seed alone picks where the path starts.
    ring = np.stack([(np.arange(20) - 1) % 20, (np.arange(20) + 1) % 20], axis=1)
    starts = {int(greedy_path(ring, np.ones((20, 2), np.float32), seed)[0][0]) for seed in range(6)}
    assert len(starts) > 1


def test_chains_cut_at_jumps_and_before_max_tokens():
    path = np.array([0, 1, 2, 3, 4, 5])
    linked = np.array([False, True, True, False, True, True])
    lengths = np.array([10, 10, 10, 50, 10, 10])
    chains = chains_from_path(path, linked, lengths, max_chain_tokens=25)
    assert [c.tolist() for c in chains] == [[0, 1], [2], [3], [4, 5]]  # a 50-token document stays whole


def test_exact_and_ivf_neighbours_agree_with_brute_force():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    sim = x @ x.T
    np.fill_diagonal(sim, -np.inf)
    truth = np.argsort(-sim, axis=1)[:, :5]
    ids, sims = nearest_neighbors(x, 5, CFG)
    assert np.array_equal(ids, truth)
    np.testing.assert_allclose(sims, np.take_along_axis(sim, truth, 1), rtol=1e-5)
    ivf_ids, _ = nearest_neighbors(x, 5, SimilarityBatchingConfig(exact_search_max_documents=100))
    recall = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(ivf_ids, truth)])
    assert recall > 0.9


def test_config_is_validated():
    with pytest.raises(ValueError, match="num_neighbors"):
        SimilarityBatchingConfig(num_neighbors=0)
    with pytest.raises(ValueError, match="max_chain_tokens"):
        SimilarityBatchingConfig(max_chain_tokens=2**31)


# ---- the derived dataset --------------------------------------------------------------------------------------


def test_chains_hold_every_training_document_once_and_valid_test_unchanged(mini, batched):
    source = list(read_documents(mini.train_prefix))
    derived = list(read_documents(batched.prefix))
    (tb, te), (vb, ve), (sb, se) = split_ranges(len(source), SPLIT)
    assert batched.split == f"{batched.num_chains},{ve - vb},{se - sb}"
    members = [m for c in range(batched.num_chains) for m in _chain_members(batched.prefix, c)]
    assert sorted(d for _, d in members) == list(range(tb, te))
    for c in (0, batched.num_chains // 2, batched.num_chains - 1):
        expected = np.concatenate([source[d] for _, d in _chain_members(batched.prefix, c)])
        assert np.array_equal(derived[c], expected)  # documents concatenated, each with its EOD
    assert [d.tolist() for d in derived[batched.num_chains :]] == [d.tolist() for d in source[vb:]]
    # megatron cuts the derived dataset back into exactly chains / valid / test
    assert split_ranges(len(derived), batched.split) == [
        (0, batched.num_chains), (batched.num_chains, batched.num_chains + ve - vb), (len(derived) - (se - sb), len(derived))
    ]
    assert len(load_domain_index(batched.prefix).doc_domain) == len(derived)


def test_validation_samples_are_those_of_the_plain_dataset(mini, batched, tmp_path):
    tok = mini.tokenizer()
    _, plain_valid, _ = build_datasets([mini.train_prefix], SEQ, (10, 12, None), 7, tmp_path, tok, split=SPLIT)
    _, sim_valid, _ = build_datasets([batched.prefix], SEQ, (10, 12, None), 7, tmp_path, tok, split=batched.split)
    assert len(sim_valid) == len(plain_valid)
    for i in range(len(plain_valid)):
        assert torch.equal(sim_valid[i]["tokens"], plain_valid[i]["tokens"])


@pytest.mark.slow
def test_training_samples_hold_neighbouring_documents(mini, batched, tmp_path):
    """A sample's consecutive documents are nearest neighbours (by the suite's representation)."""
    tok = mini.tokenizer()
    n_samples = 1000
    train, _, _ = build_datasets([batched.prefix], SEQ, (n_samples, None, None), 3, tmp_path, tok, split=batched.split)
    source = list(read_documents(mini.train_prefix))
    (tb, te) = split_ranges(len(source), SPLIT)[0]
    domains = load_domain_index(mini.train_prefix)
    # The kNN graph over the training documents, recomputed independently of the build.
    rows = np.stack([np.zeros(te - tb, np.int64), np.arange(tb, te)], axis=1)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    emb = similarity.document_embeddings([IndexedDataset(mini.train_prefix)], rows, 1 << 16, tok.eod, CFG)
    ids, _ = nearest_neighbors(emb, CFG.num_neighbors, CFG)
    neighbours = {(tb + i, tb + int(j)) for i in range(len(ids)) for j in ids[i] if j >= 0}

    adjacent, linked, same_domain = 0, 0, 0
    for i in range(n_samples):
        _, seq_ids, offsets = _sample_token_documents(train, i)
        docs = _token_sources(batched.prefix, seq_ids, offsets)
        for k in range(1, len(docs)):
            (_, a), (_, b) = docs[k - 1], docs[k]
            if a == b or seq_ids[k - 1] != seq_ids[k]:
                continue  # same document, or a boundary between two chains
            adjacent += 1
            linked += (a, b) in neighbours or (b, a) in neighbours
            same_domain += domains.doc_domain[a] == domains.doc_domain[b]
    assert adjacent >= 30
    assert linked == adjacent  # every document boundary inside a chain is a graph edge
    # ... and the edges mostly join documents of one domain, far above random pairs (1 / #domains-ish).
    assert same_domain / adjacent > 0.8
    assert batched.stats["same_domain_adjacent"] > 2 * batched.stats["same_domain_random"]
    assert batched.stats["adjacent_similarity"] > batched.stats["random_similarity"]


def test_cache_reuse_new_key_and_never_overwriting(mini, batched, tmp_path):
    again = build_similarity_dataset([mini.train_prefix], SPLIT, CFG)
    assert again.reused and again.prefix == batched.prefix and again.stats == batched.stats
    other = SimilarityBatchingConfig(num_neighbors=3, embedding_dim=16, max_chain_tokens=2048)
    # A file of the derived name that the module did not write is refused and left as it was.
    import hashlib
    import json

    key = hashlib.sha256(
        json.dumps(
            {"format": similarity.FORMAT, "sources": [similarity.dataset_fingerprint(mini.train_prefix)],
             "split": SPLIT, "config": __import__("dataclasses").asdict(other), "vocab_size": None, "eod": None},
            sort_keys=True,
        ).encode()
    ).hexdigest()
    foreign = f"{mini.train_prefix}.simbatch-{key[:16]}.bin"
    with open(foreign, "w") as f:
        f.write("not ours")
    try:
        with pytest.raises(ReproError, match="not written by similarity batching"):
            build_similarity_dataset([mini.train_prefix], SPLIT, other)
        assert open(foreign).read() == "not ours"
    finally:
        os.unlink(foreign)
    fresh = build_similarity_dataset([mini.train_prefix], SPLIT, other)
    assert not fresh.reused and fresh.prefix != batched.prefix


@pytest.mark.slow
def test_failed_build_leaves_nothing(mini, monkeypatch):
    parent = os.path.dirname(mini.train_prefix)
    before = set(os.listdir(parent))

    def boom(*args, **kwargs):
        raise RuntimeError("index failed")

    monkeypatch.setattr(similarity, "IndexedDatasetBuilder", boom)
    with pytest.raises(RuntimeError, match="index failed"):
        build_similarity_dataset([mini.train_prefix], SPLIT, SimilarityBatchingConfig(num_neighbors=2, seed=99))
    left = {p for p in set(os.listdir(parent)) - before if not p.endswith(".lock")}
    assert left == set()


def test_bad_inputs_are_one_line_errors(mini, tmp_path, capsys):
    with pytest.raises(ReproError, match="no such indexed dataset"):
        build_similarity_dataset([str(tmp_path / "missing")], SPLIT, CFG)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ReproError, match="bad split"):
        warnings.simplefilter("always")
        build_similarity_dataset([mini.train_prefix], "0,0,0", CFG)
    assert [str(w.message) for w in caught] == [], "one line, no numpy warning before it"
    assert similarity.main([str(tmp_path / "missing")]) == 2
    assert "no such indexed dataset" in capsys.readouterr().err


# ---- token counts (Hash's balanced table) ----------------------------------------------------------------------


def test_token_counts_cover_the_training_documents_only(mini):
    source = list(read_documents(mini.train_prefix))
    (tb, te) = split_ranges(len(source), SPLIT)[0]
    expected = np.bincount(np.concatenate(source[tb:te]), minlength=1024)
    counts = count_tokens([mini.train_prefix], SPLIT, vocab_size=1024)
    assert np.array_equal(counts, expected)
    path = token_counts_file([mini.train_prefix], SPLIT, vocab_size=1024)
    assert np.array_equal(np.load(path), expected)
    assert token_counts_file([mini.train_prefix], SPLIT, vocab_size=1024) == path  # reused
    with pytest.raises(ReproError, match="vocab_size"):
        count_tokens([mini.train_prefix], SPLIT, vocab_size=10)
