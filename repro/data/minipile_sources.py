"""The mini-pile's sources, per domain: where its documents come from and how a file becomes a document text.

``python_code`` (half the stdlib), ``python_docstrings`` (the other half's, pydoc-like), ``python_reference``
(``pydoc_data.topics``), ``licenses``, ``man_pages`` (English, troff stripped by :func:`troff_to_text`),
``c_headers`` (/usr/include).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import os
import re
import sysconfig
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ALL_DOMAINS = ("python_code", "python_docstrings", "python_reference", "licenses", "man_pages", "c_headers")


@dataclass(frozen=True)
class Candidate:
    """One file (or entry) of a source: ``key`` (path under the source root, stable per image) and ``path``."""

    key: str
    path: Path


@dataclass(frozen=True)
class Source:
    """One domain's source.

    Attributes:
        name: one of :data:`ALL_DOMAINS`.
        list: candidates in a fixed order (``OSError`` for an unreadable directory).
        read: a candidate's document text, or None to skip it.
        family: a candidate's family, capped by ``MiniPileConfig.max_docs_per_family`` (e.g. ``gcloud-*`` man pages).
    """

    name: str
    list: Callable[[], list[Candidate]]
    read: Callable[[Candidate], str | None]
    family: Callable[[Candidate], str] | None = None


# third-party packages, test suites, generated codec tables, and the reference text (its own domain)
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                               "encodings", "pydoc_data"})


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_modules(half: int) -> list[Candidate]:
    """Stdlib ``.py`` files of one half of a fixed hash partition (code and docstrings never share a module)."""
    root = _stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(n for n in filenames if n.endswith(".py")):
            path = Path(dirpath) / name
            key = path.relative_to(root).as_posix()
            if int(hashlib.sha1(f"stdlib-half:{key}".encode()).hexdigest(), 16) % 2 == half:
                out.append(Candidate(key, path))
    return out


def _read_text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        return (gzip.decompress(data) if path.name.endswith(".gz") else data).decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None


def _docstrings(cand: Candidate) -> str | None:
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
    doc = ast.get_docstring(tree)
    parts = [f"{module}\n{doc}" if doc else module]

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


def _reference_topics() -> list[Candidate]:
    spec = importlib.util.find_spec("pydoc_data.topics")
    if spec is None or spec.origin is None:
        return []
    from pydoc_data.topics import topics

    return [Candidate(k, Path(spec.origin)) for k in sorted(topics)]


def _files(paths: Iterable[Path], root: Path, prefix: str = "") -> list[Candidate]:
    return [Candidate(prefix + p.relative_to(root).as_posix(), p) for p in sorted(paths) if p.is_file()]


def _license_files() -> list[Candidate]:
    common, docs = Path("/usr/share/common-licenses"), Path("/usr/share/doc")
    return (_files([_stdlib_dir() / "LICENSE.txt"], _stdlib_dir(), "stdlib/")
            + (_files(common.iterdir(), common, "common-licenses/") if common.is_dir() else [])
            + _files(docs.glob("*/copyright"), docs, "doc/"))


def _man_files() -> list[Candidate]:
    root = Path("/usr/share/man")  # English pages only: translations live in /usr/share/man/<lang>/
    return [c for s in range(1, 9) if (root / f"man{s}").is_dir() for c in _files((root / f"man{s}").iterdir(), root)]


def domain_sources() -> tuple[Source, ...]:
    """One :class:`Source` per domain, in the order of :data:`ALL_DOMAINS`."""
    return (
        Source("python_code", lambda: _stdlib_modules(0), lambda c: _read_text(c.path)),
        Source("python_docstrings", lambda: _stdlib_modules(1), _docstrings),
        Source("python_reference", _reference_topics,
               lambda c: importlib.import_module("pydoc_data.topics").topics.get(c.key)),
        Source("licenses", _license_files, lambda c: _read_text(c.path)),
        Source("man_pages", _man_files, lambda c: None if (src := _read_text(c.path)) is None else troff_to_text(src),
               lambda c: re.split(r"[-_.]", c.path.name, maxsplit=1)[0]),
        Source("c_headers", lambda: _files(Path("/usr/include").rglob("*.h"), Path("/usr/include")),
               lambda c: _read_text(c.path)),
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
    def sub(m: re.Match) -> str:  # a glyph or one-character escape by its table, every other escape dropped
        if m.group("char") is not None:
            return _TROFF_CHAR.get(m.group("char"), "")
        return _TROFF_NAMED.get(m.group("named") or m.group("bracket") or "", "")

    return _TROFF_ESCAPE.sub(sub, text)


def troff_to_text(src: str) -> str | None:
    """Strip man(7) troff markup to readable plain text (a light converter, not a full troff).

    Returns:
        The text, or ``None`` for ``src`` that is a ``.so`` redirection stub or an mdoc(7) page (not handled).
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
