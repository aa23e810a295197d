"""The README and the reference pages under docs/ stay navigable: every relative link points to a file that
exists and, for a Markdown target, to a heading that exists; every page is reachable from the README."""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) or ![alt](target); a target has no spaces (a title after one is ignored).
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def pages(root: Path) -> list[Path]:
    """The README and every docs/*.md under ``root``."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's ``-1``, ``-2`` suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text()):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: Path, root: Path) -> list[str]:
    """The relative links of ``path`` whose file (or heading, for a Markdown file) does not exist under ``root``.

    Args:
        path: a Markdown file.
        root: the repository root; a link may not leave it.

    Returns:
        one ``file:line: target (why)`` per broken link.
    """
    broken = []
    # Fenced lines blanked and code spans emptied (keeping their newlines), so a link wrapped over two
    # lines is still one link and its line number still counts from the top.
    prose = dict(_prose_lines(path.read_text()))
    text = "\n".join(prose.get(n, "") for n in range(1, max(prose, default=0) + 1))
    text = _CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for match in _LINK.finditer(text):
        target, number = match.group(1), text.count("\n", 0, match.start(1)) + 1
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.is_relative_to(root.resolve()):
            broken.append(f"{where} (outside the repository)")
        elif not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading with this anchor)")
    return broken


def test_every_relative_link_in_the_readme_and_docs_resolves():
    found = pages(ROOT)
    assert len(found) > 1, "docs/*.md missing"
    broken = [b for page in found for b in broken_links(page, ROOT)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {t.partition("#")[0] for t in _LINK.findall(readme)}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_readme_stays_short():
    """The README leads; the reference lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_checker_catches_a_missing_file_a_missing_anchor_and_an_escape(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "topic.md").write_text("# Topic\n\n## Lory's similarity batching (`--x`)\n\n## Twice\n\n## Twice\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/topic.md#lorys-similarity-batching---x) [again](docs/topic.md#twice-1) [web](https://x.org/a)\n"
        "[gone](docs/nothing.md) [bad anchor](docs/topic.md#no-such-heading) [up](../outside.md)\n"
        "`[in code](docs/nothing.md)`\n"
        "```\n[in a fence](docs/nothing.md)\n```\n"
        "[self](#also-missing) [wrapped over\ntwo lines](docs/gone.md)\n"
    )
    broken = broken_links(tmp_path / "README.md", tmp_path)
    assert [b.split(": ", 1)[1] for b in broken] == [
        "docs/nothing.md (no such file)",
        "docs/topic.md#no-such-heading (no heading with this anchor)",
        "../outside.md (outside the repository)",
        "#also-missing (no heading with this anchor)",
        "docs/gone.md (no such file)",
    ]
    assert broken[-1].startswith("README.md:8: ")  # the line where the target is


def test_the_development_layout_names_every_module():
    """docs/development.md's layout block names every Python file of the packages (a new module is listed)."""
    text = (ROOT / "docs" / "development.md").read_text()
    block = text[text.index("```\nnoxfile.py"):]
    block = block[: block.index("```", 4)]
    files = [p for pkg in ("routers", "baselines", "repro") for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py"]
    assert len(files) > 80
    missing = sorted(str(p.relative_to(ROOT)) for p in files if p.name not in block and p.stem not in block)
    assert missing == [], f"modules the layout does not name: {missing}"


def test_no_page_or_generated_file_names_a_command_of_an_earlier_version():
    """Commands renamed in the seven-command tree (``mini`` -> ``study mini``) answer with one line, but a page that
    shows the old name sends a reader there: the README, docs and results (but the H100 archives, which keep the
    command lines of the commits they ran, as results/h100/findings.md says) name the current ones."""
    from repro.cli import MOVED

    old = re.compile(r"(?:python -m repro|dirmoe-bench) (" + "|".join(map(re.escape, MOVED)) + r")\b")
    pages = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*")]
    pages += [p for p in ROOT.glob("results/**/*") if p.is_file() and p.suffix in (".md", ".tex", ".json", "")
              and "h100" not in p.relative_to(ROOT).parts]
    stale = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in pages if p.is_file()
             for m in old.finditer(p.read_text(errors="replace"))]
    assert not stale, stale
    assert old.search("see `python -m repro mini --seeds 3`") and not old.search("python -m repro study mini")


def test_every_decimal_figure_of_the_h100_findings_is_in_its_records():
    """results/h100/findings.md is written by hand beside the records it reads: each figure with a decimal point
    must be a number those records hold, as printed or rounded to the digits shown. The exceptions are named:
    sums of recorded figures, and the norms' cost read from a Chrome trace the folder does not keep (the text
    says so). A figure typed without a record (as its CPU losses once were) fails."""
    root = ROOT / "results" / "h100"
    plain = functools.partial(re.sub, r"(?<=\d),(?=\d{3})", "")  # 10,461 -> 10461
    records = "\n".join(plain(p.read_text(errors="replace")) for p in sorted(root.rglob("*"))
                        if p.is_file() and p.name != "findings.md")
    values = [float(v) for v in re.findall(r"\d+(?:\.\d+)?", records)]
    held = {d: {f"{v:.{d}f}" for v in values} for d in range(1, 5)}
    text = plain((root / "findings.md").read_text())
    figures = set(re.findall(r"(?<![\w.\-/])\d+\.\d+(?![\w.]*\d)", text))
    sums = {"29.1": ("13.6", "15.5"), "29.3": ("13.8", "15.5")}  # DirMoE's router fwd + bwd ms, before and after
    untraced = {"21.3", "17.3"}
    for total, parts in sums.items():
        assert all(p in held[1] for p in parts) and f"{sum(map(float, parts)):.1f}" == total, (total, parts)
    unheld = sorted(f for f in figures if f not in held[len(f.split(".")[1])] and f not in sums and f not in untraced)
    assert len(figures) > 60 and unheld == [], f"figures without a record: {unheld}"
    assert (sums.keys() | untraced) <= figures  # a stale exception fails too
