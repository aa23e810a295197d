"""One nox session per experiment, plus tests / lint / bench / mini.

CPU machines get torch 2.13.0's CPU wheel before anything else (an unpinned torch would pull a multi-GB
CUDA build); machines with ``nvidia-smi`` keep whatever CUDA torch the environment resolves.
Run ``nox --list`` for the sessions and what each does.
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]

CPU_TORCH = "torch==2.13.0"
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def _install(session: nox.Session, extras: str = "dev,eval") -> None:
    """Install the project (editable) with ``extras``, CPU torch first on CPU machines."""
    if not _has_gpu():
        session.install(CPU_TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (CPU, a few minutes)."""
    _install(session)
    session.run("pytest", *(session.posargs or ["-q"]), env=OFFLINE_ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """Router micro-benchmarks (pytest-benchmark): forward+backward at T=4096, D=768, E=8, k=1; JSON in results/bench/."""
    _install(session)
    os.makedirs("results/bench", exist_ok=True)
    session.run(
        "pytest",
        "benchmarks",
        "--benchmark-only",
        "--benchmark-enable",
        "--benchmark-json=results/bench/routers.json",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env=OFFLINE_ENV,
    )
    session.run("python", "-m", "repro", "bench-table", "results/bench/routers.json", env=OFFLINE_ENV)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the project."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "routers", "baselines", "repro", "tests", "benchmarks", "noxfile.py")


@nox.session
def mini(session: nox.Session) -> None:
    """The main job on the embedded default: the whole router comparison on CPU."""
    _install(session)
    session.run("python", "-m", "repro", "mini", *session.posargs, env=OFFLINE_ENV)
