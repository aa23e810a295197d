"""``python -m repro report writeup``: the result write-ups, generated from the results files alone.

Each study declares its write-ups (module ``WRITEUPS``, collected by :func:`repro.studies.registry.writeups`).
Each ``results/<study>/`` gets a ``README.md`` (command, findings, its ``.md`` tables), and the repository's
README a block per study between ``<!-- BEGIN generated: <study> -->`` and ``<!-- END generated: <study> -->``.

Every number is read from a results file or computed from the per-seed values they hold; every comparison word
is chosen by a test result (:mod:`repro.report.verdicts`). ``--check`` exits 1 where a committed file is stale.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from repro.errors import ReproError
from repro.report.verdicts import Writeup
from repro.studies.registry import writeups

_BLOCK = re.compile(r"(<!-- BEGIN generated: (?P<name>[\w.+-]+) -->\n)(?P<body>.*?)(<!-- END generated: (?P=name) -->)", re.S)


# ------------------------------------------------------------------------------------------ writing
def generate(root: Path) -> list[Writeup]:
    """Every study's write-up from ``root/results`` (studies without a directory left out)."""
    return [make(root / "results" / name) for name, make in writeups().items() if (root / "results" / name).is_dir()]


def fill_blocks(text: str, writeups: Sequence[Writeup], origin: str = "README.md") -> str:
    """``text`` with the body of each ``BEGIN generated: <study>`` block replaced by that study's block.

    Raises:
        ReproError: a block names a study with no write-up.
    """
    by_name = {w.study: w for w in writeups}

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in by_name:
            raise ReproError(f"{origin}: a generated block names '{name}', which has no results directory")
        return match.group(1) + by_name[name].block.rstrip() + "\n" + match.group(4)

    return _BLOCK.sub(replace, text)


def targets(root: Path) -> dict[Path, str]:
    """Every generated file under ``root`` and the text it should hold."""
    writeups = generate(root)
    out = {root / "results" / w.study / "README.md": w.readme for w in writeups}
    readme = root / "README.md"
    if readme.is_file():
        out[readme] = fill_blocks(readme.read_text(), writeups, str(readme))
    return out


def main(argv: list[str], prog: str) -> int:
    """Write (or ``--check``) the write-ups. Returns the exit status (1: ``--check`` found a stale file)."""
    parser = argparse.ArgumentParser(prog=prog, description="Write the result write-ups from the results files.")
    parser.add_argument("--root", default=".", help="repository root (default: the current directory)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is out of date")
    args = parser.parse_args(argv)
    stale = {path: text for path, text in targets(Path(args.root)).items()
             if not path.is_file() or path.read_text() != text}
    for path, text in stale.items():
        if args.check:
            print(f"out of date: {path} (run python -m repro report writeup)")
        else:
            path.write_text(text)
            print(f"wrote {path}")
    return 1 if args.check and stale else 0
