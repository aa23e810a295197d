"""The embedded "mini-pile": a small multi-domain corpus built from text already on any machine (docs/data.md).

Domains: :mod:`repro.data.minipile_sources` (missing ones skipped, >= ``min_domains``). Deterministic per machine
image and seed (seeded hash order over sorted files, per-domain byte budget, exact duplicates dropped); the held-out
part (by text hash, >= 1 per domain) never enters training or the tokenizer. ``manifest.json`` keys each stage
(corpus: config + source fingerprint; tokenizer: + vocab settings; indexed); one whose key and files match is reused.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from repro.data.minipile_sources import ALL_DOMAINS, Candidate, Source, domain_sources
from repro.data.pile import PileRecord, iter_pile_documents, write_pile_shard
from repro.data.tokenizer import Gpt2BpeTokenizer, load_tokenizer, train_bpe_tokenizer
from repro.errors import ReproError
from repro.io_utils import make_parents, open_in_dir, read_json, write_json_atomic

MANIFEST_FORMAT = 1
_TOKENIZER_RELS = ("tokenizer/vocab.json", "tokenizer/merges.txt")


@dataclass(frozen=True)
class MiniPileConfig:
    """What the mini-pile is built from (every field is part of the cache key).

    Attributes:
        max_bytes_per_domain: UTF-8 bytes per domain, held-out part included.
        max_doc_bytes: longer documents skipped (one huge file must not fill a domain).
        min_doc_chars: shorter documents skipped.
        heldout_fraction: share of documents held out for evaluation.
        vocab_size: BPE vocabulary, ``<|endoftext|>`` included.
        min_frequency: least pair count for a BPE merge.
        max_docs_per_family: cap per source family (man pages named ``gcloud-*``, ...).
        num_shards: training shards.
        seed: seeds the visiting order, held-out choice and document order.
        domains: default: every :data:`ALL_DOMAINS` entry whose source exists.
        min_domains: fewer found is an error.
    """

    max_bytes_per_domain: int = 2_000_000
    max_doc_bytes: int = 200_000
    min_doc_chars: int = 200
    heldout_fraction: float = 0.03
    vocab_size: int = 8192
    min_frequency: int = 2
    max_docs_per_family: int = 5
    num_shards: int = 2
    seed: int = 1234
    domains: tuple[str, ...] | None = None
    min_domains: int = 4

    def validate(self) -> None:
        """Raise a ReproError for a value out of range."""
        if self.max_bytes_per_domain < 1000:
            raise ReproError(f"max_bytes_per_domain {self.max_bytes_per_domain} is too small (at least 1000)")
        if not 0.0 < self.heldout_fraction < 0.5:
            raise ReproError(f"heldout_fraction {self.heldout_fraction} must be in (0, 0.5)")
        if self.num_shards < 1:
            raise ReproError(f"num_shards {self.num_shards} must be at least 1")
        if self.domains is not None:
            unknown = sorted(set(self.domains) - set(ALL_DOMAINS))
            if unknown:
                raise ReproError(f"unknown mini-pile domain(s) {', '.join(unknown)}; valid: {', '.join(ALL_DOMAINS)}")


@dataclass(frozen=True)
class DomainStats:
    """Per-domain size of the mini-pile's training and held-out parts (bytes of UTF-8 text, tokens with EOD)."""

    documents: int
    bytes: int
    tokens: int
    heldout_documents: int
    heldout_bytes: int
    heldout_tokens: int


@dataclass(frozen=True)
class MiniPile:
    """A built mini-pile (layout: :func:`build_mini_pile`), its domains, stats, timings and cache reuse."""

    root: Path
    train_shards: tuple[Path, ...]
    heldout_path: Path
    vocab_path: Path
    merges_path: Path
    train_prefix: str
    heldout_prefix: str
    domains: tuple[str, ...]
    stats: dict[str, DomainStats]
    skipped_domains: dict[str, str]
    build_seconds: float
    tokenize_tokens_per_second: float
    reused: bool

    def tokenizer(self) -> Gpt2BpeTokenizer:
        return load_tokenizer(self.vocab_path, self.merges_path)


def _h(*parts: object) -> str:
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).hexdigest()


def _fingerprint(cands: list[Candidate]) -> str:
    h = hashlib.sha256()
    for c in cands:
        try:
            st = c.path.stat()
            h.update(f"{c.key}\x1f{st.st_size}\x1f{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{c.key}\x1fmissing\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class _Doc:
    domain: str
    text: str
    sha: str


def _collect(source: Source, cands: list[Candidate], cfg: MiniPileConfig, seen: set[str]) -> list[_Doc]:
    """Fill one domain up to its byte budget, visiting candidates in a seeded hash order."""
    docs, total = [], 0
    per_family: dict[str | None, int] = {}
    for cand in sorted(cands, key=lambda c: _h(cfg.seed, source.name, c.key)):
        if total >= cfg.max_bytes_per_domain:
            break
        fam = None if source.family is None else source.family(cand)
        if fam is not None and per_family.get(fam, 0) >= cfg.max_docs_per_family:
            continue
        text = source.read(cand)
        if text is None:
            continue
        text = text.replace("\r\n", "\n").replace("\x00", "")
        size = len(text.encode("utf-8"))
        if len(text.strip()) < cfg.min_doc_chars or size > cfg.max_doc_bytes:
            continue
        sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if sha in seen:  # exact duplicates (symlinked licences, identical copyright files, ...)
            continue
        seen.add(sha)
        per_family[fam] = per_family.get(fam, 0) + 1
        docs.append(_Doc(source.name, text, sha))
        total += size
    return docs


def _split_heldout(docs: list[_Doc], cfg: MiniPileConfig) -> tuple[list[_Doc], list[_Doc]]:
    """Hold out documents by a hash of their text; at least one per domain that has two or more."""
    score = {d.sha: int(_h(cfg.seed, "heldout", d.sha)[:15], 16) / float(16**15) for d in docs}  # in [0, 1)
    held = {d.sha for d in docs if score[d.sha] < cfg.heldout_fraction}
    by_domain: dict[str, list[_Doc]] = {}
    for d in docs:
        by_domain.setdefault(d.domain, []).append(d)
    for domain_docs in by_domain.values():
        if len(domain_docs) >= 2 and not any(d.sha in held for d in domain_docs):
            held.add(min(domain_docs, key=lambda d: score[d.sha]).sha)
    order = sorted(docs, key=lambda d: _h(cfg.seed, "order", d.sha))  # mixes domains across shards/splits
    return [d for d in order if d.sha not in held], [d for d in order if d.sha in held]


def _files_ok(root: Path, sizes: dict[str, int]) -> bool:
    return bool(sizes) and all((root / r).is_file() and (root / r).stat().st_size == n for r, n in sizes.items())


def _sizes(root: Path, rels: Sequence[str]) -> dict[str, int]:
    return {rel: (root / rel).stat().st_size for rel in rels}


def _load_manifest(path: Path) -> dict:
    manifest = read_json(path)  # none, unreadable or of another format: rebuild everything
    return manifest if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT else {}


# What a build puts in its directory (plus atomic writers' temporaries, ``.<name>.<random>.tmp``).
_MINI_PILE_ENTRIES = frozenset({".build.lock", "manifest.json", "shards", "heldout.jsonl", "tokenizer", "indexed"})


def build_mini_pile(out_dir: str | os.PathLike, config: MiniPileConfig | None = None, *, num_workers: int | None = None,
                    force: bool = False, progress: bool = False, log: Callable[[str], None] | None = None) -> MiniPile:
    """Build (or reuse) the mini-pile: ``shards/train-NN.jsonl.zst``, ``heldout.jsonl``,
    ``tokenizer/{vocab.json,merges.txt}``, ``indexed/{train,heldout}.*`` (+ domain sidecar), ``manifest.json``.

    Args:
        config: default :class:`MiniPileConfig()` (ReproError: invalid, or < ``min_domains`` domains here).
        num_workers: tokeniser threads (default: all cores); output unaffected.
        force: rebuild every stage even if cached.
        progress: show progress bars while tokenising.
        log: called with one line per stage (e.g. ``print``); default silent.
    """
    cfg = config or MiniPileConfig()
    cfg.validate()
    t_start = time.perf_counter()
    root = Path(out_dir)
    # Refuse a directory holding anything but a (partial) mini-pile: the stages rewrite and delete files there.
    foreign = sorted(p.name for p in (root.iterdir() if root.is_dir() else ()) if p.name not in _MINI_PILE_ENTRIES
                     and not (p.name.startswith(".") and p.name.endswith(".tmp")))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ReproError(f"{root}: holds files that are not the mini-pile's ({shown}); build it into a new or empty "
                         "directory")
    make_parents(root)
    # One caller builds, the others wait and reuse (closing unlocks); append mode: no truncation via a symlink.
    with open_in_dir(root, ".build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        say = log or (lambda _msg: None)
        manifest_path = root / "manifest.json"
        old_stages = {} if force else _load_manifest(manifest_path).get("stages", {})
        listed, skipped = _list_sources(cfg)
        fingerprints = {name: _fingerprint(cands) for name, (_, cands) in listed.items()}
        corpus_key = _h("corpus", MANIFEST_FORMAT, json.dumps(dataclasses.asdict(cfg), sort_keys=True),
                        json.dumps(fingerprints, sort_keys=True))
        tokenizer_key = _h("tokenizer", corpus_key, cfg.vocab_size, cfg.min_frequency)
        indexed_key = _h("indexed", tokenizer_key)
        stages: dict = {}
        manifest: dict = {"format": MANIFEST_FORMAT, "config": dataclasses.asdict(cfg), "stages": stages}

        def stage(name: str, key: str, folder: str, reusable: bool, build: Callable[[], tuple[dict, str]]) -> bool:
            """Reuse stage ``name`` if ``reusable`` and key and files match, else ``build`` it; whether reused."""
            prev = old_stages.get(name, {})
            if reusable and prev.get("key") == key and _files_ok(root, prev.get("files", {})):
                stages[name] = prev
                say(f"{name}: reused ({root / folder})")
                return True
            # Forget this and later stages on disk first: after a crash no key may vouch for half-rewritten files.
            write_json_atomic(manifest_path, manifest)
            stages[name], line = build()
            write_json_atomic(manifest_path, manifest)
            say(line)
            return False

        shard_rels = _shard_rels(cfg)
        reused_all = stage("corpus", corpus_key, "shards", True,
                           lambda: _write_corpus(root, cfg, corpus_key, listed, skipped, shard_rels))
        reused_all = stage("tokenizer", tokenizer_key, "tokenizer", reused_all,
                           lambda: _train_tokenizer(root, cfg, tokenizer_key, shard_rels))
        reused_all = stage("indexed", indexed_key, "indexed", reused_all,
                           lambda: _tokenize(root, indexed_key, shard_rels, num_workers, progress))
        return _mini_pile(root, stages, shard_rels, reused_all, t_start)


def _shard_rels(cfg: MiniPileConfig) -> list[str]:
    return [f"shards/train-{i:02d}.jsonl.zst" for i in range(cfg.num_shards)]


def open_mini_pile(out_dir: str | os.PathLike) -> MiniPile:
    """The default-config mini-pile as its manifest records it, without re-listing sources (thousands of files);
    if absent, partial or different, :func:`build_mini_pile`."""
    t_start = time.perf_counter()
    root = Path(out_dir)
    if (root / "manifest.json").is_file():
        with open_in_dir(root, ".build.lock", "a") as lock:  # not while another process is building
            fcntl.flock(lock, fcntl.LOCK_EX)
            manifest = _load_manifest(root / "manifest.json")
        cfg = MiniPileConfig()
        stages = manifest.get("stages", {})
        if manifest.get("config") == json.loads(json.dumps(dataclasses.asdict(cfg))) and all(
                _files_ok(root, stages.get(name, {}).get("files", {})) for name in ("corpus", "tokenizer", "indexed")):
            return _mini_pile(root, stages, _shard_rels(cfg), True, t_start)
    return build_mini_pile(root)


def _list_sources(cfg: MiniPileConfig) -> tuple[dict[str, tuple[Source, list[Candidate]]], dict[str, str]]:
    """``(domain -> (source, candidates), domain -> why it was skipped)`` of the wanted domains."""
    wanted = set(cfg.domains or ALL_DOMAINS)
    listed: dict[str, tuple[Source, list[Candidate]]] = {}
    skipped: dict[str, str] = {}
    for source in domain_sources():
        if source.name not in wanted:
            continue
        try:
            cands = source.list()
        except OSError as exc:  # an unreadable directory: treat the source as absent
            skipped[source.name] = f"source unreadable ({exc.strerror or exc})"
            continue
        if cands:
            listed[source.name] = (source, cands)
        else:
            skipped[source.name] = "source not found on this machine"
    return listed, skipped


def _write_corpus(root: Path, cfg: MiniPileConfig, key: str, listed: dict[str, tuple[Source, list[Candidate]]],
                  skipped: dict[str, str], shard_rels: list[str]) -> tuple[dict, str]:
    """Stage 1: select documents, write training shards and held-out file; returns (manifest entry, log line)."""
    t0 = time.perf_counter()
    seen: set[str] = set()
    docs: list[_Doc] = []
    for name, (source, cands) in listed.items():
        docs += (got := _collect(source, cands, cfg, seen))
        if not got:
            skipped[name] = "no usable document"
    present = sorted({d.domain for d in docs}, key=ALL_DOMAINS.index)
    if len(present) < cfg.min_domains:
        found = ", ".join(present) or "none"
        why = ", ".join(f"{k}: {v}" for k, v in skipped.items())
        raise ReproError(f"mini-pile: only {len(present)} domain(s) available on this machine ({found}); "
                         f"need at least {cfg.min_domains} (skipped: {why})")
    train, heldout = _split_heldout(docs, cfg)
    # contiguous runs of the (already shuffled) training order, one per shard
    per = -(-len(train) // cfg.num_shards)
    for i, rel in enumerate(shard_rels):
        write_pile_shard(root / rel, (PileRecord(d.text, d.domain) for d in train[i * per : (i + 1) * per]))
    for stale in (root / "shards").glob("train-*.jsonl.zst"):  # left by a build with more shards
        if stale.relative_to(root).as_posix() not in shard_rels:
            stale.unlink()
    write_pile_shard(root / "heldout.jsonl", (PileRecord(d.text, d.domain) for d in heldout))
    entry = {"key": key, "files": _sizes(root, shard_rels + ["heldout.jsonl"]), "domains": present,
             "skipped": skipped, "seconds": time.perf_counter() - t0}
    return entry, (f"corpus: {len(train)} training + {len(heldout)} held-out documents in {len(present)} domains "
                   f"({entry['seconds']:.1f} s)")


def _train_tokenizer(root: Path, cfg: MiniPileConfig, key: str, shard_rels: list[str]) -> tuple[dict, str]:
    """Stage 2: the tokenizer, trained on the training shards only."""
    t0 = time.perf_counter()
    texts = (text for text, _ in iter_pile_documents([root / r for r in shard_rels]))
    train_bpe_tokenizer(texts, root / "tokenizer", vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency)
    entry = {"key": key, "files": _sizes(root, _TOKENIZER_RELS), "seconds": time.perf_counter() - t0}
    return entry, f"tokenizer: vocabulary {cfg.vocab_size} trained ({entry['seconds']:.1f} s)"


def _tokenize(root: Path, key: str, shard_rels: list[str], num_workers: int | None, progress: bool) -> tuple[dict, str]:
    """Stage 3: the indexed datasets (same reader + tokeniser path as The Pile)."""
    from routers.registry import quiet_megatron_import

    with quiet_megatron_import():
        from repro.data.indexed import tokenize_shards  # imports megatron-core: only when this stage runs

    tok = load_tokenizer(*(root / rel for rel in _TOKENIZER_RELS))
    inputs = {"train": [root / r for r in shard_rels], "heldout": [root / "heldout.jsonl"]}
    stats = {part: tokenize_shards(paths, tok, root / "indexed" / part, num_workers=num_workers, progress=progress)
             for part, paths in inputs.items()}
    train = stats["train"]
    files = [f"indexed/{part}{ext}" for part in inputs for ext in (".bin", ".idx", ".domains.json", ".domains.npy")]
    entry = {"key": key, "files": _sizes(root, files), "seconds": train.seconds + stats["heldout"].seconds,
             "tokens_per_second": train.tokens_per_second,
             **{part: {"documents": st.documents, "bytes": st.bytes, "tokens": st.tokens}
                for part, st in stats.items()}}
    return entry, f"indexed: {train.num_tokens:,} training tokens at {train.tokens_per_second:,.0f} tokens/s"


def _mini_pile(root: Path, stages: dict, shard_rels: list[str], reused_all: bool, t_start: float) -> MiniPile:
    """The :class:`MiniPile` of a build whose stages are all recorded in ``stages``."""
    ix = stages["indexed"]
    domains = tuple(stages["corpus"]["domains"])
    stats = {d: DomainStats(*(ix[part][key].get(d, 0) for part in ("train", "heldout")
                              for key in ("documents", "bytes", "tokens"))) for d in domains}
    return MiniPile(root=root, train_shards=tuple(root / r for r in shard_rels), heldout_path=root / "heldout.jsonl",
                    vocab_path=root / _TOKENIZER_RELS[0], merges_path=root / _TOKENIZER_RELS[1],
                    train_prefix=str(root / "indexed/train"), heldout_prefix=str(root / "indexed/heldout"),
                    domains=domains, stats=stats, skipped_domains=dict(stages["corpus"].get("skipped", {})),
                    build_seconds=time.perf_counter() - t_start, reused=reused_all,
                    tokenize_tokens_per_second=float(ix.get("tokens_per_second", float("nan"))))
