"""Golden loss curves: fixed-seed training losses of a few routers on the embedded default, committed under
``tests/assets/losses/``, and the comparison of a fresh run against them (docs/development.md).

A change not meant to alter what training computes must leave them as they are (``tests/test_golden.py``
compares every step); one meant to alter them regenerates them with ``python -m repro golden --refresh``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from repro.errors import ReproError

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "tests" / "assets" / "losses"
#: Routers of different kinds: softmax top-k, sampled Dirichlet, fixed token-id map, parameter merging.
ROUTERS: tuple[str, ...] = ("switch", "dirmoe", "hash", "lory")
STEPS = 30
#: Per-step tolerance |new - golden| <= ATOL + RTOL * |golden|: runs are bit-exact on one machine; this absorbs
#: float32 differences between CPU instruction sets.
RTOL, ATOL = 1e-4, 1e-5
REFRESH = "python -m repro golden --refresh"


@dataclass(frozen=True)
class GoldenCurve:
    """Training loss (LM plus aux) of steps 1..N of ``<router>-tiny``, corpus fingerprint and torch version."""

    router: str
    losses: tuple[float, ...]
    data: str
    torch: str


def golden_path(router: str, root: Path = GOLDEN_DIR) -> Path:
    return root / f"{router}-tiny.txt"


def corpus_fingerprint(data_dir: str | Path) -> str:
    """sha256 over the mini-pile's training tokens (``.bin``/``.idx``) and its tokenizer files."""
    from repro.data.minipile import open_mini_pile

    mini = open_mini_pile(data_dir)
    digest = hashlib.sha256()
    for path in (mini.train_prefix + ".bin", mini.train_prefix + ".idx", mini.vocab_path, mini.merges_path):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def run_curve(router: str, data_dir: str | Path, work_dir: str | Path) -> GoldenCurve:
    """Train ``<router>-tiny`` for :data:`STEPS` steps on the mini-pile in ``work_dir/<router>`` (new or empty)."""
    import torch

    from repro.config import apply_overrides
    from repro.experiments import get_experiment
    from repro.records.step_log import read_rows
    from repro.training.trainer import train

    torch.set_num_threads(1)
    sets = [f"schedule.steps={STEPS}", f"data.source=mini-pile:{data_dir}", "validation.interval=0", "checkpoint.interval=0"]
    out = Path(work_dir) / router
    train(apply_overrides(get_experiment(f"{router}-tiny"), sets), out, progress=False)
    losses = tuple(row.loss for row in read_rows(out))
    return GoldenCurve(router, losses, corpus_fingerprint(data_dir), torch.__version__)


def write_golden(curve: GoldenCurve, root: Path = GOLDEN_DIR) -> Path:
    """Write a curve file (comment lines with the settings, then ``step loss`` per line)."""
    path = golden_path(curve.router, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# golden loss curve of {curve.router}-tiny: {STEPS} steps on the mini-pile, one thread, the experiment's seed",
        f"# regenerate with: {REFRESH}",
        f"# data: {curve.data}",
        f"# torch: {curve.torch}",
        *(f"{step} {loss!r}" for step, loss in enumerate(curve.losses, 1)),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_golden(router: str, root: Path = GOLDEN_DIR) -> GoldenCurve:
    """Read a curve file (ReproError naming file and line if missing or malformed)."""
    path = golden_path(router, root)
    meta: dict[str, str] = {}
    losses: list[float] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ReproError(f"{path}: no golden loss curve ({exc.strerror or exc}); create it with {REFRESH}") from None
    for number, line in enumerate(lines, 1):
        if line.startswith("#"):
            key, sep, value = line[1:].partition(":")
            if sep:
                meta[key.strip()] = value.strip()
            continue
        try:
            step, loss = line.split()
            if int(step) != len(losses) + 1 or not math.isfinite(float(loss)):
                raise ValueError
        except ValueError:
            raise ReproError(f"{path}:{number}: expected 'step loss' with steps 1, 2, ..., got {line!r}") from None
        losses.append(float(loss))
    return GoldenCurve(router, tuple(losses), meta.get("data", ""), meta.get("torch", ""))


def differences(new: GoldenCurve, golden: GoldenCurve) -> list[str]:
    """What does not match, one line each (empty: the curves agree within the tolerance)."""
    if len(new.losses) != len(golden.losses):
        return [f"{new.router}: {len(new.losses)} steps, the golden curve has {len(golden.losses)}"]
    return [f"{new.router} step {step}: loss {a!r}, golden {b!r} (relative {abs(a - b) / abs(b):.2e})"
            for step, (a, b) in enumerate(zip(new.losses, golden.losses), 1) if abs(a - b) > ATOL + RTOL * abs(b)]


def main(argv: list[str], prog: str = "python -m repro golden") -> int:
    """Compare fresh runs with the golden curves (exit 1 on a difference), or ``--refresh`` them."""
    parser = argparse.ArgumentParser(prog=prog, description="Golden loss curves of a few routers on the embedded default.")
    parser.add_argument("--refresh", action="store_true", help="rewrite tests/assets/losses/ from fresh runs")
    parser.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated (default {','.join(ROUTERS)})")
    parser.add_argument("--data-dir", default="data/mini-pile", help="the mini-pile (built if missing)")
    args = parser.parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="golden-") as work:
        for router in routers:
            curve = run_curve(router, args.data_dir, work)
            if args.refresh:
                print(f"wrote {write_golden(curve)}")
                continue
            golden = read_golden(router)
            if golden.data != curve.data:
                raise ReproError(f"{golden_path(router)}: recorded on another corpus (data {golden.data[:12]}, "
                                 f"this machine's {curve.data[:12]}): the curves are not comparable here")
            found = differences(curve, golden)
            failed += found
            print(f"{router}: {'ok' if not found else f'{len(found)} steps differ'} ({len(curve.losses)} steps)")
    for line in failed:
        print(line, file=sys.stderr)
    return 1 if failed else 0
