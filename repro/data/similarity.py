"""Similarity-based data batching (Lory, Sec. 3.2 and Appendix C): similar documents in the same sequences.

Lory's experts specialise by domain only when the tokens of adjacent segments come from related documents,
so the paper builds its training instances by concatenating similar documents, following In-Context
Pretraining (Shi et al., ICLR 2024, arXiv:2310.10638, Sec. 2 and Algorithm 1):

1. represent every document by a vector and retrieve its top-k nearest neighbours by cosine similarity
   (approximate search with FAISS);
2. walk the document graph greedily (a maximum travelling-salesman heuristic): start at an unvisited
   document of minimum degree, repeatedly move to the most similar unvisited neighbour, and when every
   neighbour of the current document is visited, jump to another unvisited minimum-degree document;
3. concatenate the documents in the order of that path and cut the stream into training instances.

How the suite does it with megatron-core 0.16.1's ``GPTDataset`` (``megatron/core/datasets/gpt_dataset.py``,
read for this): ``GPTDataset`` splits an indexed dataset by *sequence* index (``numel_low_level_dataset``),
shuffles the split's sequence ids once per epoch (``_build_document_index``), concatenates the sequences in
that order, cuts the stream into samples of ``seq_length + 1`` tokens (``sample_index``) and shuffles the
samples (``shuffle_index``). A random document order would undo step 3, so :func:`build_similarity_dataset`
writes a *derived* indexed dataset in which every sequence is a **chain**: a run of the path whose
consecutive documents are graph neighbours, each document still ending with its EOD token. The document
shuffle then moves whole chains, and a sample's documents are consecutive documents of one chain except for
the samples that straddle two chains. Chains are cut at the path's jumps and at ``max_chain_tokens`` (a
sequence length is an int32 in megatron's index), and written in a seeded random order.

Train/valid/test: the chains are built from the source's *training* documents only (megatron's split of
the source, same rounding); the source's validation and test documents follow unchanged, and
:attr:`SimilarityBatched.split` is the split string (``"chains,valid,test"`` counts) under which megatron
cuts the derived dataset back into exactly those three ranges. The validation documents are the same ones,
in the same order, so for one source prefix the validation samples are identical to those of a run without
similarity batching (tested), and the validation loss stays comparable across routers. Several prefixes are
merged into one derived dataset (neighbours are searched across all of them); this equals megatron's
default blend (weights proportional to tokens) for training, but the validation samples are then those of
one dataset, not of megatron's blend.

Deviations from the paper (documented defaults):

1. Document representation: the paper embeds documents with Contriever (Izacard et al. 2022), a pretrained
   retriever that cannot be downloaded here. The suite uses TF-IDF over the document's token ids (sublinear
   term frequency, scikit-learn's ``TfidfTransformer``, EOD excluded) reduced to ``embedding_dim`` dimensions
   by truncated SVD (latent semantic analysis, scikit-learn's ``TruncatedSVD``) and L2-normalised, so the
   inner product is the cosine similarity. It needs no download and works on any tokenised corpus; it
   measures lexical rather than semantic similarity.
2. Neighbour search: FAISS, as the paper: exact inner product (``IndexFlatIP``) up to
   ``exact_search_max_documents`` documents, an inverted-file index (``IndexIVFFlat``, ``4 sqrt(N)`` lists,
   ``nprobe`` 32) above.
3. The ICLM pipeline's semantic deduplication step is not applied (the mini-pile drops exact duplicates
   when it is built; The Pile is used as distributed).
4. The document graph: an undirected edge joins two documents when either is among the other's k nearest
   neighbours (ICLM), weighted by their cosine similarity; ties of minimum degree are broken by a seeded
   permutation (ICLM: a random minimum-degree document).

Everything is cached beside the source data, keyed by a hash of the inputs (the sources' index files and
data sizes, the split, the options and the format), as ``<first prefix>.simbatch-<key>``: a complete derived
dataset with a matching manifest is reused, files of that name that this module did not write are never
overwritten (an error names them), and a build writes under temporary names and renames into place only
when everything succeeded.

The ordering (steps 1 and 2, and the chains of step 3) is in :mod:`repro.data.similarity_chains`, whose
names (and the options, :class:`SimilarityBatchingConfig`) are importable from here too; this module holds
the split, the cache and the derived dataset's files.

Command line (to build once before a multi-GPU run): ``python -m repro.data.similarity PREFIX [PREFIX...]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from repro.data.indexed import DOMAINS_JSON, DOMAINS_NPY, load_domain_index
from repro.data.similarity_chains import (  # noqa: F401 (re-exported)
    SimilarityBatchingConfig,
    chains_from_path,
    document_embeddings,
    greedy_path,
    nearest_neighbors,
)
from repro.errors import ReproError

FORMAT = 1
DEFAULT_SPLIT = "969,30,1"
#: Suffixes of the files of a derived dataset besides ``.bin``/``.idx``.
CHAINS_NPZ = ".chains.npz"
MANIFEST_JSON = ".simbatch.json"
@dataclass(frozen=True)
class SimilarityBatched:
    """A derived, similarity-batched indexed dataset (what :func:`build_similarity_dataset` returns).

    Attributes:
        prefix: the derived indexed-dataset prefix, for :func:`repro.data.datasets.build_datasets`.
        split: the split string to build it with (the chains train; the sources' valid/test documents).
        sources: the source prefixes.
        source_split: the split of the sources the chains were built from.
        num_chains: derived sequences of the training part.
        stats: how similar the chained documents are (see :func:`build_similarity_dataset`).
        reused: whether the cached dataset was reused.
    """

    prefix: str
    split: str
    sources: tuple[str, ...]
    source_split: str
    num_chains: int
    stats: dict
    reused: bool

    def chain_members(self, chain: int) -> list[tuple[int, int]]:
        """``[(source index, document id), ...]`` of one chain, in order."""
        offsets, members = _load_chains(self.prefix)
        return [tuple(int(v) for v in m) for m in members[offsets[chain] : offsets[chain + 1]]]

    def token_sources(self, sequence: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """Map positions of derived sequences to the source documents they come from.

        Args:
            sequence: derived sequence ids (e.g. from :func:`repro.data.datasets.sample_token_documents`).
            offset: token positions inside those sequences (-1 for padding).

        Returns:
            ``[n, 2]`` int64 ``(source index, document id)`` per position (-1 for padding); for a
            validation or test sequence, the source document it copies.
        """
        offsets, members = _load_chains(self.prefix)
        lengths = _load_chains_lengths(self.prefix)
        out = np.full((len(sequence), 2), -1, dtype=np.int64)
        for i, (seq, off) in enumerate(zip(np.asarray(sequence), np.asarray(offset))):
            if seq < 0:
                continue
            lo, hi = offsets[seq], offsets[seq + 1]
            ends = np.cumsum(lengths[lo:hi])
            out[i] = members[lo + int(np.searchsorted(ends, off, side="right"))]
        return out


# ------------------------------------------------------------------------------------------ split ranges
def split_ranges(num_sequences: int, split: str) -> list[tuple[int, int] | None]:
    """megatron-core's train/valid/test sequence ranges of one indexed dataset.

    The same expressions as ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``:
    ``beg = int(round(split[i][0] * n))``, ``end = int(round(split[i][1] * n))``.

    Args:
        num_sequences: n, the sequences (documents) of the dataset.
        split: megatron's split string, e.g. ``"969,30,1"``.

    Returns:
        Three ``(beg, end)`` pairs, None for a split without a share.
    """
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    n = float(num_sequences)
    return [None if b is None else (int(round(b[0] * n)), int(round(b[1] * n))) for b in matrix]


# ------------------------------------------------------------------------------------------- the build
def _id_bound(dataset: IndexedDataset) -> int:
    """An upper bound of the token ids: the range of a small index dtype, else the largest id + 1."""
    dtype = np.dtype(dataset.index.dtype)
    if dtype.itemsize <= 2:
        return int(np.iinfo(dtype).max) + 1
    total = int(np.sum(dataset.sequence_lengths, dtype=np.int64))
    return int(dataset.bin_reader.read(dtype=dataset.index.dtype, count=total, offset=0).max()) + 1


def dataset_fingerprint(prefix: str) -> str:
    """Hash of an indexed dataset's identity: its whole index file, its data size and its domain sidecar."""
    h = hashlib.sha256()
    with open(prefix + ".idx", "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    h.update(str(os.path.getsize(prefix + ".bin")).encode())
    for ext in (DOMAINS_JSON, DOMAINS_NPY):
        path = prefix + ext
        h.update(Path(path).read_bytes() if os.path.isfile(path) else b"-")
    return h.hexdigest()


def _derived_files(prefix: str) -> list[str]:
    # .idx then the manifest last: the manifest vouches for a complete dataset.
    return [prefix + ext for ext in (CHAINS_NPZ, DOMAINS_NPY, DOMAINS_JSON, ".bin", ".idx", MANIFEST_JSON)]


def _load_chains(prefix: str) -> tuple[np.ndarray, np.ndarray]:
    with np.load(prefix + CHAINS_NPZ, allow_pickle=False) as z:
        return z["offsets"], z["members"]


def _load_chains_lengths(prefix: str) -> np.ndarray:
    with np.load(prefix + CHAINS_NPZ, allow_pickle=False) as z:
        return z["lengths"]


def _read_manifest(prefix: str) -> dict | None:
    try:
        with open(prefix + MANIFEST_JSON) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def build_similarity_dataset(
    prefixes: Sequence[str | os.PathLike],
    split: str = DEFAULT_SPLIT,
    config: SimilarityBatchingConfig | None = None,
    *,
    vocab_size: int | None = None,
    eod: int | None = None,
    log=None,
) -> SimilarityBatched:
    """Build (or reuse) the similarity-batched derived dataset of ``prefixes`` (see the module docstring).

    Args:
        prefixes: source indexed-dataset prefixes (written by :mod:`repro.data.indexed`, domain sidecar
            included); the derived dataset is written beside the first.
        split: the split the run uses for the sources (megatron's ``split``); the chains come from the
            training part only.
        config: the options (default :class:`SimilarityBatchingConfig()`).
        vocab_size: token-id bound of the count matrix; default: the range of the index's token dtype
            (65536 for GPT-2's uint16), or the largest id + 1 for wider dtypes.
        eod: the end-of-document id to leave out of the representation; default: the last token of the
            first document (every document of :mod:`repro.data.indexed` ends with it).
        log: called with one line per stage (e.g. ``print``); default silent.

    Returns:
        :class:`SimilarityBatched`. Its ``stats`` hold ``documents``, ``chains``, ``mean_chain_tokens``,
        ``linked_fraction`` (path steps along an edge), ``adjacent_similarity`` (mean cosine similarity of
        consecutive documents of a chain), ``random_similarity`` (mean over random pairs, the baseline),
        ``same_domain_adjacent`` / ``same_domain_random`` (share of pairs from the same domain) and
        ``seconds``.

    Raises:
        ReproError: a missing source, a split leaving the training part empty, or existing files of the
            derived name that this module did not write.
    """
    cfg = config or SimilarityBatchingConfig()
    say = log or (lambda _msg: None)
    sources = [str(p) for p in prefixes]
    if not sources:
        raise ReproError("similarity batching: no indexed dataset given")
    for prefix in sources:
        if not IndexedDataset.exists(prefix):
            raise ReproError(f"{prefix}.idx / {prefix}.bin: no such indexed dataset")
        for ext in (DOMAINS_JSON, DOMAINS_NPY):
            if not os.path.isfile(prefix + ext):
                raise ReproError(f"{prefix}{ext}: no such file (domain sidecar of indexed dataset {prefix})")
    try:
        split_ranges(1, split)
    except Exception as exc:  # megatron asserts on a malformed split
        raise ReproError(f"similarity batching: bad split '{split}' ({exc or type(exc).__name__})") from None
    key = hashlib.sha256(
        json.dumps(
            {
                "format": FORMAT,
                "sources": [dataset_fingerprint(p) for p in sources],
                "split": split,
                "config": dataclasses.asdict(cfg),
                "vocab_size": vocab_size,
                "eod": eod,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    out_prefix = f"{sources[0]}.simbatch-{key[:16]}"
    parent = Path(out_prefix).parent
    with open(parent / f".{Path(out_prefix).name}.lock", "w") as lock:
        # Ranks of one run may call this at once: one builds, the others wait and reuse.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest = _read_manifest(out_prefix)
            complete = all(os.path.isfile(p) for p in _derived_files(out_prefix))
            if manifest is not None and manifest.get("key") == key and complete:
                say(f"similarity batching: reused {out_prefix}")
                return _result(out_prefix, manifest, reused=True)
            ours = manifest is not None and manifest.get("format") == FORMAT and "key" in manifest
            present = [p for p in _derived_files(out_prefix) if os.path.exists(p)]
            if present and not ours:
                raise ReproError(
                    f"{present[0]}: exists but was not written by similarity batching; "
                    "move it away (it is not overwritten)"
                )
            manifest = _build(sources, split, cfg, key, out_prefix, vocab_size, eod, say)
            return _result(out_prefix, manifest, reused=False)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _result(prefix: str, manifest: dict, reused: bool) -> SimilarityBatched:
    return SimilarityBatched(
        prefix=prefix,
        split=manifest["derived_split"],
        sources=tuple(manifest["sources"]),
        source_split=manifest["split"],
        num_chains=int(manifest["num_chains"]),
        stats=dict(manifest["stats"]),
        reused=reused,
    )


def _build(sources, split, cfg, key, out_prefix, vocab_size, eod, say) -> dict:
    t0 = time.perf_counter()
    datasets = [IndexedDataset(p) for p in sources]
    domains = [load_domain_index(p) for p in sources]
    train, valid, test = _documents_by_split(datasets, sources, split)
    lengths = np.array([int(datasets[s].sequence_lengths[d]) for s, d in train], dtype=np.int64)

    if vocab_size is None:
        vocab_size = max(_id_bound(ds) for ds in datasets)
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

    parent = Path(out_prefix).parent
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{Path(out_prefix).name}.", suffix=".tmp", dir=parent))
    tmp = str(tmp_dir / Path(out_prefix).name)
    try:
        names, seq_domain = _write_sequences(tmp, datasets, domains, train, chains, lengths, (valid, test))
        index_dtype = np.uint8 if len(names) <= 1 << 8 else np.uint16 if len(names) <= 1 << 16 else np.uint32
        np.save(tmp + DOMAINS_NPY, np.asarray(seq_domain, dtype=index_dtype))
        first_meta = json.loads(Path(sources[0] + DOMAINS_JSON).read_text())
        sidecar = {
            "domains": names,
            "num_documents": len(seq_domain),
            "similarity_batched_from": sources,
            "tokenizer": first_meta.get("tokenizer", {}),
        }
        Path(tmp + DOMAINS_JSON).write_text(json.dumps(sidecar, indent=2))
        stats["seconds"] = time.perf_counter() - t0
        manifest = {
            "format": FORMAT,
            "key": key,
            "sources": sources,
            "split": split,
            "derived_split": f"{len(chains)},{len(valid)},{len(test)}",
            "num_chains": len(chains),
            "config": dataclasses.asdict(cfg),
            "vocab_size": vocab_size,
            "eod": eod,
            "stats": stats,
        }
        Path(tmp + MANIFEST_JSON).write_text(json.dumps(manifest, indent=2))
        for tmp_file, final in zip(_derived_files(tmp), _derived_files(out_prefix)):
            os.replace(tmp_file, final)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        del datasets
    say(
        f"similarity batching: {stats['chains']} chains of {stats['documents']} documents, adjacent cosine "
        f"{stats['adjacent_similarity']:.3f} vs random {stats['random_similarity']:.3f} "
        f"({stats['seconds']:.1f} s) -> {out_prefix}"
    )
    return manifest


def _documents_by_split(
    datasets: Sequence[IndexedDataset], sources: Sequence[str], split: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sources' training, validation and test documents under megatron's split of each source.

    Returns:
        Three ``[n, 2]`` int64 arrays of ``(source index, document id)`` rows, sources in order.

    Raises:
        ReproError: the split leaves no training document.
    """
    ranges = [split_ranges(len(ds), split) for ds in datasets]
    train_docs, valid_docs, test_docs = [], [], []
    for s, r in enumerate(ranges):
        for bucket, bounds in zip((train_docs, valid_docs, test_docs), r):
            if bounds is not None and bounds[1] > bounds[0]:
                ids = np.arange(bounds[0], bounds[1], dtype=np.int64)
                bucket.append(np.stack([np.full_like(ids, s), ids], axis=1))
    if not train_docs:
        raise ReproError(f"similarity batching: split '{split}' leaves no training document in {', '.join(sources)}")
    train = np.concatenate(train_docs)
    valid = np.concatenate(valid_docs) if valid_docs else np.zeros((0, 2), np.int64)
    test = np.concatenate(test_docs) if test_docs else np.zeros((0, 2), np.int64)
    return train, valid, test


def _chain_stats(chains, linked, lengths, emb, train, domains, rng: np.random.Generator) -> dict:
    """How similar the chained documents are: consecutive documents of a chain against random pairs.

    Returns:
        The ``stats`` of :func:`build_similarity_dataset` but ``seconds``.
    """
    pairs = np.array([(c[i], c[i + 1]) for c in chains for i in range(len(c) - 1)], dtype=np.int64).reshape(-1, 2)
    rand = rng.integers(0, len(train), size=(max(1, min(100_000, len(pairs) or 1000)), 2))
    dom = np.array([domains[s].doc_domain[d] for s, d in train])
    dom_name = np.array([domains[s].names[int(dom[i])] for i, (s, _) in enumerate(train)]) if len(train) else dom

    def mean_sim(p):
        return float(np.mean(np.sum(emb[p[:, 0]] * emb[p[:, 1]], axis=1))) if len(p) else float("nan")

    def same_domain(p):
        return float(np.mean(dom_name[p[:, 0]] == dom_name[p[:, 1]])) if len(p) else float("nan")

    return {
        "documents": int(len(train)),
        "chains": len(chains),
        "mean_chain_tokens": float(np.mean([lengths[c].sum() for c in chains])),
        "linked_fraction": float(linked[1:].mean()) if len(linked) > 1 else 0.0,
        "adjacent_similarity": mean_sim(pairs),
        "random_similarity": mean_sim(rand),
        "same_domain_adjacent": same_domain(pairs),
        "same_domain_random": same_domain(rand),
    }


def _write_sequences(tmp, datasets, domains, train, chains, lengths, unchanged) -> tuple[list[str], list[int]]:
    """Write the derived sequences (``tmp.bin``/``.idx``) and their members (``tmp`` + :data:`CHAINS_NPZ`).

    Args:
        tmp: the temporary prefix.
        datasets: the source indexed datasets.
        domains: their domain sidecars.
        train: ``[n, 2]`` training documents; ``chains`` index its rows.
        chains: the chains, in their written order.
        lengths: tokens of each training document.
        unchanged: the validation and test documents, each written as a sequence of its own.

    Returns:
        ``(domain names, domain id of each sequence)`` for the domain sidecar.
    """
    builder = None
    try:
        dtype = datasets[0].index.dtype
        builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
        names: list[str] = []
        seq_domain: list[int] = []

        def domain_id(name: str) -> int:
            if name not in names:
                names.append(name)
            return names.index(name)

        offsets, members, member_lengths = [0], [], []
        for chain in chains:
            rows = train[chain]
            tokens = np.concatenate([np.asarray(datasets[s][int(d)]) for s, d in rows])
            builder.add_document(tokens, [tokens.size])
            # The chain's domain for the sidecar: the one with most tokens (per-document domains are in
            # the chains file).
            by_domain: dict[str, int] = {}
            for (s, d), n in zip(rows, lengths[chain]):
                name = domains[s].domain_of(int(d))
                by_domain[name] = by_domain.get(name, 0) + int(n)
            seq_domain.append(domain_id(max(by_domain, key=by_domain.get)))
            members.append(rows)
            member_lengths.append(lengths[chain])
            offsets.append(offsets[-1] + len(chain))
        for rows in unchanged:
            for s, d in rows:
                tokens = np.asarray(datasets[s][int(d)])
                builder.add_document(tokens, [tokens.size])
                seq_domain.append(domain_id(domains[s].domain_of(int(d))))
                members.append(np.array([[s, d]], dtype=np.int64))
                member_lengths.append(np.array([tokens.size], dtype=np.int64))
                offsets.append(offsets[-1] + 1)
        builder.finalize(tmp + ".idx")
    finally:
        if builder is not None:
            builder.data_file.close()
    np.savez(
        tmp + CHAINS_NPZ,
        offsets=np.asarray(offsets, dtype=np.int64),
        members=np.concatenate(members).astype(np.int64),
        lengths=np.concatenate(member_lengths).astype(np.int64),
    )
    return names, seq_domain


# ---------------------------------------------------------------------------------------------- command
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m repro.data.similarity PREFIX [PREFIX...] [--split S]``: build the derived dataset once."""
    parser = argparse.ArgumentParser(prog="python -m repro.data.similarity", description=__doc__.split("\n")[0])
    parser.add_argument("prefixes", nargs="+", help="indexed-dataset prefixes (with their domain sidecars)")
    parser.add_argument("--split", default=DEFAULT_SPLIT, help="the run's train/valid/test split")
    for field in dataclasses.fields(SimilarityBatchingConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    args = parser.parse_args(argv)
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimilarityBatchingConfig)}
    try:
        cfg = SimilarityBatchingConfig(**options)
        result = build_similarity_dataset(args.prefixes, args.split, cfg, log=print)
    except (ReproError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"prefix": result.prefix, "split": result.split, **result.stats}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
