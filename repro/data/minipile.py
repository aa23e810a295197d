"""The embedded "mini-pile": a small multi-domain corpus built from text already on any machine.

The CPU default of the suite trains on it with exactly the full-scale pipeline: it is written as Pile shards
(``*.jsonl.zst`` with ``meta.pile_set_name``), a GPT-2-format byte-level BPE (``vocab.json`` +
``merges.txt``) is trained on its training part, and the shards are tokenised into megatron-core indexed
datasets by the same code that tokenises The Pile.

Domains (each skipped when its source is missing; at least ``min_domains`` must remain):

==================  ===================================================================================
``python_code``     Python standard-library modules, source (one half of the modules)
``python_docstrings``  docstrings of the other half of the modules, pydoc-like (disjoint from the code)
``python_reference``   the language reference shipped inside the interpreter (``pydoc_data.topics``)
``licenses``        licence texts: the stdlib's LICENSE.txt, /usr/share/common-licenses, package copyrights
``man_pages``       English manual pages (/usr/share/man/man1-8), troff markup stripped
``c_headers``       C headers (/usr/include)
==================  ===================================================================================

Selection is deterministic for a given machine image and seed: sorted file lists, visited in a seeded hash
order, each domain filled up to ``max_bytes_per_domain``, exact duplicate texts dropped. A held-out part
(``heldout_fraction`` of documents, chosen by a hash of the text, at least one per domain) is written to
``heldout.jsonl`` for evaluation and never enters the training shards, the tokenizer or the training prefix.

Everything lives under one output directory and is rebuilt only when its inputs change: ``manifest.json``
records a key per stage (corpus = config + fingerprint of the source files; tokenizer = corpus key + vocab
settings; indexed = tokenizer key), and a stage whose key and output files match is reused.
"""

from __future__ import annotations

import ast
import dataclasses
import fcntl
import gzip
import hashlib
import importlib.util
import json
import os
import re
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from repro.data.pile import PileRecord, iter_pile_documents, write_pile_shard
from repro.data.tokenizer import Gpt2BpeTokenizer, load_tokenizer, train_bpe_tokenizer
from repro.errors import ReproError
from repro.io_utils import make_parents, open_in_dir, write_json_atomic

MANIFEST_FORMAT = 1
ALL_DOMAINS = ("python_code", "python_docstrings", "python_reference", "licenses", "man_pages", "c_headers")


@dataclass(frozen=True)
class MiniPileConfig:
    """What the mini-pile is built from (every field is part of the cache key).

    Attributes:
        max_bytes_per_domain: text (UTF-8 bytes) taken per domain, held-out part included.
        max_doc_bytes: longer documents are skipped (keeps one huge file from filling a domain).
        min_doc_chars: shorter documents are skipped.
        heldout_fraction: share of documents held out for evaluation.
        vocab_size: BPE vocabulary size, ``<|endoftext|>`` included.
        min_frequency: least pair count for a BPE merge.
        max_docs_per_family: most documents from one family of a source (man pages named ``gcloud-*``, ...).
        num_shards: training shards to write.
        seed: seeds the file visiting order, the held-out choice and the document order.
        domains: the domains to use (default: all of :data:`ALL_DOMAINS` whose sources exist).
        min_domains: fewer domains found than this is an error.
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
    """Per-domain size of the mini-pile (training part and held-out part).

    Attributes:
        documents: training documents.
        bytes: training text, UTF-8 bytes.
        tokens: training tokens (EOD included).
        heldout_documents: held-out documents.
        heldout_bytes: held-out text, UTF-8 bytes.
        heldout_tokens: held-out tokens (EOD included).
    """

    documents: int
    bytes: int
    tokens: int
    heldout_documents: int
    heldout_bytes: int
    heldout_tokens: int


@dataclass(frozen=True)
class MiniPile:
    """A built mini-pile: what the training pipeline and the evaluation read.

    Attributes:
        root: the output directory.
        train_shards: training shards (Pile format, ``*.jsonl.zst``).
        heldout_path: the held-out documents (Pile format, plain ``heldout.jsonl``), for evaluation.
        vocab_path: GPT-2-format ``vocab.json``.
        merges_path: GPT-2-format ``merges.txt``.
        train_prefix: indexed dataset of the training shards (for :func:`repro.data.datasets.build_datasets`).
        heldout_prefix: indexed dataset of the held-out documents (for per-domain perplexity).
        domains: the domain names present.
        stats: per-domain :class:`DomainStats`.
        skipped_domains: domain -> why it was skipped on this machine.
        build_seconds: wall time of this call.
        tokenize_tokens_per_second: tokenisation throughput of the training prefix, when it was built
            (recorded in the manifest and reported again when reused).
        reused: True when every stage was reused from the cache.
    """

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
        """Load the mini-pile's tokenizer (through the GPT-2 loading path)."""
        return load_tokenizer(self.vocab_path, self.merges_path)

    @property
    def manifest_path(self) -> Path:
        """The manifest recording keys, stats and timings."""
        return self.root / "manifest.json"


# ---------------------------------------------------------------------------------------------------------
# Sources: each lists candidates (stable key, path) and reads one into a document text (or None to skip).
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    key: str  # stable across machines with the same image: a path relative to the source root
    path: Path


@dataclass(frozen=True)
class _Source:
    name: str
    list: Callable[[], list[_Candidate]]
    read: Callable[[_Candidate], str | None]
    # Candidates of one family (e.g. the ~16k ``gcloud-*`` man pages) are capped so one family cannot fill
    # a domain; None = no families.
    family: Callable[[_Candidate], str] | None = None


_STDLIB_SKIP_DIRS = frozenset(
    # third-party packages, test suites, generated codec tables, and the reference text (its own domain)
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_modules(half: int) -> list[_Candidate]:
    """Stdlib ``.py`` files of one half of a fixed hash partition (code and docstrings never share a module)."""
    root = _stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            key = path.relative_to(root).as_posix()
            if int(hashlib.sha1(f"stdlib-half:{key}".encode()).hexdigest(), 16) % 2 == half:
                out.append(_Candidate(key, path))
    return out


def _read_text(path: Path) -> str | None:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None


def _docstrings(cand: _Candidate) -> str | None:
    """A pydoc-like page of a module's docstrings: the module's, then each class's and function's."""
    src = _read_text(cand.path)
    if src is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old modules
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            return None
    module = cand.key[: -len(".py")].replace("/", ".").removesuffix(".__init__")
    parts = []
    doc = ast.get_docstring(tree)
    parts.append(f"{module}\n{doc}" if doc else module)

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                d = ast.get_docstring(child)
                bases = ", ".join(ast.unparse(b) for b in child.bases)
                if d:
                    parts.append(f"class {owner}{child.name}({bases})\n" + _indent(d))
                visit(child, f"{owner}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                d = ast.get_docstring(child)
                if d:
                    parts.append(f"{owner}{child.name}({ast.unparse(child.args)})\n" + _indent(d))

    visit(tree, "")
    if len(parts) == 1 and not doc:
        return None
    return "\n\n".join(parts) + "\n"


def _indent(text: str) -> str:
    return "\n".join(("    " + line) if line else "" for line in text.split("\n"))


def _reference_topics() -> list[_Candidate]:
    spec = importlib.util.find_spec("pydoc_data.topics")
    if spec is None or spec.origin is None:
        return []
    from pydoc_data.topics import topics

    return [_Candidate(k, Path(spec.origin)) for k in sorted(topics)]


def _reference_text(cand: _Candidate) -> str | None:
    from pydoc_data.topics import topics

    return topics.get(cand.key)


def _license_files() -> list[_Candidate]:
    out = []
    lic = _stdlib_dir() / "LICENSE.txt"
    if lic.is_file():
        out.append(_Candidate("stdlib/LICENSE.txt", lic))
    common = Path("/usr/share/common-licenses")
    if common.is_dir():
        out += [_Candidate(f"common-licenses/{p.name}", p) for p in sorted(common.iterdir()) if p.is_file()]
    docs = Path("/usr/share/doc")
    if docs.is_dir():
        copyrights = sorted(docs.glob("*/copyright"))
        out += [_Candidate(f"doc/{p.parent.name}/copyright", p) for p in copyrights if p.is_file()]
    return out


def _man_files() -> list[_Candidate]:
    root = Path("/usr/share/man")
    out = []
    for section in range(1, 9):  # English pages only: translations live in /usr/share/man/<lang>/
        d = root / f"man{section}"
        if d.is_dir():
            out += [_Candidate(p.relative_to(root).as_posix(), p) for p in sorted(d.iterdir()) if p.is_file()]
    return out


def _header_files() -> list[_Candidate]:
    root = Path("/usr/include")
    if not root.is_dir():
        return []
    return [_Candidate(p.relative_to(root).as_posix(), p) for p in sorted(root.rglob("*.h")) if p.is_file()]


def _source_file(cand: _Candidate) -> str | None:
    return _read_text(cand.path)


def _man_page(cand: _Candidate) -> str | None:
    src = _read_text(cand.path)
    return None if src is None else troff_to_text(src)


def _man_family(cand: _Candidate) -> str:
    return re.split(r"[-_.]", cand.path.name, maxsplit=1)[0]


def _sources() -> tuple[_Source, ...]:
    return (
        _Source("python_code", lambda: _stdlib_modules(0), _source_file),
        _Source("python_docstrings", lambda: _stdlib_modules(1), _docstrings),
        _Source("python_reference", _reference_topics, _reference_text),
        _Source("licenses", _license_files, _source_file),
        _Source("man_pages", _man_files, _man_page, _man_family),
        _Source("c_headers", _header_files, _source_file),
    )


# ---- troff (man page) markup to plain text ----

_TROFF_NAMED = {
    "aq": "'", "dq": '"', "lq": '"', "rq": '"', "oq": "'", "cq": "'", "em": "--", "en": "-", "hy": "-",
    "bu": "*", "co": "(c)", "rg": "(R)", "mu": "x", ">=": ">=", "<=": "<=", "ti": "~", "ha": "^", "ga": "`",
    "aa": "'", "ul": "_", "rs": "\\", "sl": "/", "pl": "+", "mi": "-", "eq": "=", "->": "->", "<-": "<-",
}  # fmt: skip
_TROFF_ESCAPE = re.compile(
    r"\\(?:"
    r"\((?P<named>..)"  # \(xx named glyph
    r"|\[(?P<bracket>[^\]]*)\]"  # \[xx] named glyph
    r"|[fF](?:\[[^\]]*\]|\(..|.)"  # font change
    r"|s[+-]?\d+"  # size change
    r"|\*(?:\[[^\]]*\]|\(..|.)"  # string interpolation
    r"|[nk](?:\[[^\]]*\]|\(..|.)"  # register
    r"|[hvwlLoxzbHSRNDXYZCV]'[^']*'"  # escapes with a quoted argument
    r"|(?P<char>.)"  # one-character escapes
    r")"
)
_TROFF_CHAR = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "t": "\t", "'": "'", "`": "`", ".": "."}
_ARGS = re.compile(r'"([^"]*)"|(\S+)')
_ALTERNATING = frozenset({"BR", "BI", "IB", "IR", "RB", "RI"})
_INLINE = frozenset({"B", "I", "SM", "SB", "UR", "MT", "OP"})
_BREAK = frozenset({"PP", "LP", "P", "sp", "TP", "HP", "SH", "SS", "TQ", "PD"})


def _troff_inline(text: str) -> str:
    def sub(m: re.Match) -> str:
        if m.group("named") is not None:
            return _TROFF_NAMED.get(m.group("named"), "")
        if m.group("bracket") is not None:
            return _TROFF_NAMED.get(m.group("bracket"), "")
        if m.group("char") is not None:
            return _TROFF_CHAR.get(m.group("char"), "")
        return ""

    return _TROFF_ESCAPE.sub(sub, text)


def troff_to_text(src: str) -> str | None:
    """Strip man(7) troff markup to readable plain text (a light converter, not a full troff).

    Args:
        src: the page source.

    Returns:
        The text, or ``None`` for a ``.so`` redirection stub or an mdoc(7) page (not handled).
    """
    lines = src.replace("\r\n", "\n").split("\n")
    body = [line for line in lines if line.strip() and not line.startswith(('.\\"', "'\\\"", '.\\}'))]
    if not body or body[0].startswith(".so ") or any(line.startswith((".Dd", ".Dt")) for line in body[:5]):
        return None
    out: list[str] = []
    skip_until_dots = False
    for line in lines:
        if skip_until_dots:
            skip_until_dots = line.strip() != ".."
            continue
        if line.startswith((".", "'")):
            if line.startswith(('.\\"', "'\\\"")):
                continue
            m = re.match(r"[.']\s*(\S*)\s*(.*)", line)
            name, rest = (m.group(1), m.group(2)) if m else ("", "")
            args = [a if a is not None and a != "" else b for a, b in _ARGS.findall(rest)]
            if name in ("de", "de1", "ig", "am"):
                skip_until_dots = True
            elif name == "TH" and args:
                out += [f"{args[0]}({args[1]})" if len(args) > 1 else args[0], ""]
            elif name in ("SH", "SS"):
                out += ["", _troff_inline(" ".join(args))] if args else [""]
            elif name in _ALTERNATING:
                out.append(_troff_inline("".join(args)))
            elif name in _INLINE:
                out.append(_troff_inline(" ".join(args)))
            elif name == "IP":
                out += ["", _troff_inline(args[0])] if args else [""]
            elif name in _BREAK:
                out.append("")
            continue  # every other request (.if, .nr, .ds, .in, .br, ...) carries no text
        out.append(_troff_inline(line))
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(s.rstrip() for s in out)).strip()
    return text + "\n" if text else None


# ---------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------


def _h(*parts: object) -> str:
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).hexdigest()


def _unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from its arguments."""
    return int(_h(*parts)[:15], 16) / float(16**15)


def _fingerprint(cands: list[_Candidate]) -> str:
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


def _collect(source: _Source, cands: list[_Candidate], cfg: MiniPileConfig, seen: set[str]) -> list[_Doc]:
    """Fill one domain up to its byte budget, visiting candidates in a seeded hash order."""
    order = sorted(cands, key=lambda c: _h(cfg.seed, source.name, c.key))
    docs, total = [], 0
    per_family: dict[str, int] = {}
    for cand in order:
        if total >= cfg.max_bytes_per_domain:
            break
        if source.family is not None:
            fam = source.family(cand)
            if per_family.get(fam, 0) >= cfg.max_docs_per_family:
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
        if source.family is not None:
            per_family[fam] = per_family.get(fam, 0) + 1
        docs.append(_Doc(source.name, text, sha))
        total += size
    return docs


def _split_heldout(docs: list[_Doc], cfg: MiniPileConfig) -> tuple[list[_Doc], list[_Doc]]:
    """Hold out documents by a hash of their text; at least one per domain that has two or more."""
    score = {d.sha: _unit(cfg.seed, "heldout", d.sha) for d in docs}
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
    return bool(sizes) and all(
        (root / rel).is_file() and (root / rel).stat().st_size == size for rel, size in sizes.items()
    )


def _sizes(root: Path, rels: list[str]) -> dict[str, int]:
    return {rel: (root / rel).stat().st_size for rel in rels}


def _prefix_rels(prefix_rel: str) -> list[str]:
    return [prefix_rel + ext for ext in (".bin", ".idx", ".domains.json", ".domains.npy")]


def _load_manifest(path: Path) -> dict:
    try:
        with open(path) as f:
            manifest = json.load(f)
        return manifest if manifest.get("format") == MANIFEST_FORMAT else {}
    except (OSError, ValueError):
        return {}  # no or unreadable manifest: rebuild everything


# What a build puts in its directory (plus atomic writers' temporaries, ``.<name>.<random>.tmp``).
_MINI_PILE_ENTRIES = frozenset({".build.lock", "manifest.json", "shards", "heldout.jsonl", "tokenizer", "indexed"})


def _check_mini_pile_dir(root: Path) -> None:
    """Refuse to build into an existing directory that holds anything but a (possibly partial) mini-pile.

    Stages rewrite ``shards/``, ``tokenizer/``, ``indexed/`` and delete stale shards: in someone else's
    directory that would destroy their files.
    """
    if not root.is_dir():
        return
    foreign = sorted(
        p.name for p in root.iterdir()
        if p.name not in _MINI_PILE_ENTRIES and not (p.name.startswith(".") and p.name.endswith(".tmp"))
    )
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ReproError(
            f"{root}: holds files that are not the mini-pile's ({shown}); build it into a new or empty directory"
        )


def build_mini_pile(
    out_dir: str | os.PathLike,
    config: MiniPileConfig | None = None,
    *,
    num_workers: int | None = None,
    force: bool = False,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> MiniPile:
    """Build the mini-pile under ``out_dir`` (or reuse what is there when its inputs are unchanged).

    Layout: ``shards/train-NN.jsonl.zst``, ``heldout.jsonl``, ``tokenizer/{vocab.json,merges.txt}``,
    ``indexed/train.*`` and ``indexed/heldout.*`` (``.bin``/``.idx`` + domain sidecar), ``manifest.json``.

    Args:
        out_dir: the output directory.
        config: what to build (default :class:`MiniPileConfig()`).
        num_workers: tokeniser threads (default: all cores); does not change the output.
        force: rebuild every stage even if cached.
        progress: show progress bars while tokenising.
        log: called with one line per stage (e.g. ``print``); default silent.

    Returns:
        :class:`MiniPile`.

    Raises:
        ReproError: a bad config, or fewer than ``config.min_domains`` domains available on this machine.
    """
    cfg = config or MiniPileConfig()
    cfg.validate()
    t_start = time.perf_counter()
    root = Path(out_dir)
    _check_mini_pile_dir(root)
    make_parents(root)
    # Several processes (e.g. the ranks of one torchrun) may call this at once: one builds, the others wait
    # and then reuse what it built.
    # Append mode, inside the directory only: a planted symlink cannot make the lock truncate a file elsewhere.
    with open_in_dir(root, ".build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _build_locked(root, cfg, num_workers, force, progress, log or (lambda _msg: None), t_start)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_locked(
    root: Path,
    cfg: MiniPileConfig,
    num_workers: int | None,
    force: bool,
    progress: bool,
    say: Callable[[str], None],
    t_start: float,
) -> MiniPile:
    """The body of :func:`build_mini_pile`, run while holding the output directory's lock."""
    manifest_path = root / "manifest.json"
    old = {} if force else _load_manifest(manifest_path)
    old_stages = old.get("stages", {})

    # ---- fingerprint the sources (cheap: a directory listing and stat per candidate) ----
    wanted = set(cfg.domains or ALL_DOMAINS)
    listed: dict[str, tuple[_Source, list[_Candidate]]] = {}
    skipped: dict[str, str] = {}
    for source in _sources():
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
    fingerprints = {name: _fingerprint(cands) for name, (_, cands) in listed.items()}
    corpus_key = _h(
        "corpus",
        MANIFEST_FORMAT,
        json.dumps(dataclasses.asdict(cfg), sort_keys=True),
        json.dumps(fingerprints, sort_keys=True),
    )
    tokenizer_key = _h("tokenizer", corpus_key, cfg.vocab_size, cfg.min_frequency)
    indexed_key = _h("indexed", tokenizer_key)

    stages: dict = {}
    manifest: dict = {"format": MANIFEST_FORMAT, "config": dataclasses.asdict(cfg), "stages": stages}
    reused_all = True

    # ---- stage 1: corpus (shards + held-out file) ----
    shard_rels = [f"shards/train-{i:02d}.jsonl.zst" for i in range(cfg.num_shards)]
    corpus_rels = shard_rels + ["heldout.jsonl"]
    prev = old_stages.get("corpus", {})
    if prev.get("key") == corpus_key and _files_ok(root, prev.get("files", {})):
        stages["corpus"] = prev
        say(f"corpus: reused ({root / 'shards'})")
    else:
        reused_all = False
        # Forget this stage and the later ones on disk first: a crash half-way must not leave a manifest
        # whose keys vouch for files that are being rewritten.
        write_json_atomic(manifest_path, manifest)
        t0 = time.perf_counter()
        seen: set[str] = set()
        docs: list[_Doc] = []
        for name, (source, cands) in listed.items():
            got = _collect(source, cands, cfg, seen)
            if got:
                docs += got
            else:
                skipped[name] = "no usable document"
        present = sorted({d.domain for d in docs}, key=ALL_DOMAINS.index)
        if len(present) < cfg.min_domains:
            found = ", ".join(present) or "none"
            why = ", ".join(f"{k}: {v}" for k, v in skipped.items())
            raise ReproError(
                f"mini-pile: only {len(present)} domain(s) available on this machine ({found}); "
                f"need at least {cfg.min_domains} (skipped: {why})"
            )
        train, heldout = _split_heldout(docs, cfg)
        # contiguous runs of the (already shuffled) training order, one per shard
        per = -(-len(train) // cfg.num_shards)
        for i, rel in enumerate(shard_rels):
            write_pile_shard(root / rel, (PileRecord(d.text, d.domain) for d in train[i * per : (i + 1) * per]))
        for stale in (root / "shards").glob("train-*.jsonl.zst"):  # left by a build with more shards
            if stale.relative_to(root).as_posix() not in shard_rels:
                stale.unlink()
        write_pile_shard(root / "heldout.jsonl", (PileRecord(d.text, d.domain) for d in heldout))
        stages["corpus"] = {
            "key": corpus_key,
            "files": _sizes(root, corpus_rels),
            "domains": present,
            "skipped": skipped,
            "seconds": time.perf_counter() - t0,
        }
        write_json_atomic(manifest_path, manifest)
        say(
            f"corpus: {len(train)} training + {len(heldout)} held-out documents in {len(present)} domains "
            f"({stages['corpus']['seconds']:.1f} s)"
        )

    # ---- stage 2: tokenizer, trained on the training shards only ----
    tok_rels = ["tokenizer/vocab.json", "tokenizer/merges.txt"]
    prev = old_stages.get("tokenizer", {})
    if reused_all and prev.get("key") == tokenizer_key and _files_ok(root, prev.get("files", {})):
        stages["tokenizer"] = prev
        say(f"tokenizer: reused ({root / 'tokenizer'})")
    else:
        reused_all = False
        write_json_atomic(manifest_path, manifest)
        t0 = time.perf_counter()
        texts = (text for text, _ in iter_pile_documents([root / r for r in shard_rels]))
        train_bpe_tokenizer(texts, root / "tokenizer", vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency)
        stages["tokenizer"] = {
            "key": tokenizer_key,
            "files": _sizes(root, tok_rels),
            "seconds": time.perf_counter() - t0,
        }
        write_json_atomic(manifest_path, manifest)
        say(f"tokenizer: vocabulary {cfg.vocab_size} trained ({stages['tokenizer']['seconds']:.1f} s)")

    # ---- stage 3: indexed datasets (same reader + tokeniser path as The Pile) ----
    idx_rels = _prefix_rels("indexed/train") + _prefix_rels("indexed/heldout")
    prev = old_stages.get("indexed", {})
    if reused_all and prev.get("key") == indexed_key and _files_ok(root, prev.get("files", {})):
        stages["indexed"] = prev
        say(f"indexed: reused ({root / 'indexed'})")
    else:
        reused_all = False
        write_json_atomic(manifest_path, manifest)
        with warnings.catch_warnings():  # megatron-core's import-time "no TransformerEngine/Apex" notices
            warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
            from repro.data.indexed import tokenize_shards  # imports megatron-core: only when this stage runs

        tok = load_tokenizer(root / tok_rels[0], root / tok_rels[1])
        train_stats = tokenize_shards(
            [root / r for r in shard_rels], tok, root / "indexed/train", num_workers=num_workers, progress=progress
        )
        held_stats = tokenize_shards(
            [root / "heldout.jsonl"], tok, root / "indexed/heldout", num_workers=num_workers, progress=progress
        )
        stages["indexed"] = {
            "key": indexed_key,
            "files": _sizes(root, idx_rels),
            "seconds": train_stats.seconds + held_stats.seconds,
            "tokens_per_second": train_stats.tokens_per_second,
            "train": {"documents": train_stats.documents, "bytes": train_stats.bytes, "tokens": train_stats.tokens},
            "heldout": {"documents": held_stats.documents, "bytes": held_stats.bytes, "tokens": held_stats.tokens},
        }
        write_json_atomic(manifest_path, manifest)
        say(f"indexed: {train_stats.num_tokens:,} training tokens at {train_stats.tokens_per_second:,.0f} tokens/s")

    ix = stages["indexed"]
    domains = tuple(stages["corpus"]["domains"])
    stats = {
        d: DomainStats(
            documents=ix["train"]["documents"].get(d, 0),
            bytes=ix["train"]["bytes"].get(d, 0),
            tokens=ix["train"]["tokens"].get(d, 0),
            heldout_documents=ix["heldout"]["documents"].get(d, 0),
            heldout_bytes=ix["heldout"]["bytes"].get(d, 0),
            heldout_tokens=ix["heldout"]["tokens"].get(d, 0),
        )
        for d in domains
    }
    return MiniPile(
        root=root,
        train_shards=tuple(root / r for r in shard_rels),
        heldout_path=root / "heldout.jsonl",
        vocab_path=root / tok_rels[0],
        merges_path=root / tok_rels[1],
        train_prefix=str(root / "indexed/train"),
        heldout_prefix=str(root / "indexed/heldout"),
        domains=domains,
        stats=stats,
        skipped_domains=dict(stages["corpus"].get("skipped", {})),
        build_seconds=time.perf_counter() - t_start,
        tokenize_tokens_per_second=float(ix.get("tokens_per_second", float("nan"))),
        reused=reused_all,
    )


def iter_heldout(mini: MiniPile) -> Iterator[PileRecord]:
    """Stream the held-out documents ``(text, domain)`` of a built mini-pile (for evaluation tasks).

    Args:
        mini: the built mini-pile.

    Yields:
        :class:`PileRecord` per held-out document.
    """
    return iter_pile_documents([mini.heldout_path])
