"""One nox session per experiment, plus tests / lint / bench / mini.

CPU machines get torch 2.13.0's CPU wheel before anything else (an unpinned torch would pull a multi-GB
CUDA build); machines with ``nvidia-smi`` keep whatever CUDA torch the environment resolves.
Run ``nox --list`` for the sessions and what each does.
"""

from __future__ import annotations

import argparse
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


@nox.session(name="tests-gpu", venv_backend="none")
def tests_gpu(session: nox.Session) -> None:
    """GPU tests (pytest -m gpu) in the current environment: its CUDA torch is used as is, nothing is installed."""
    session.run("python", "-m", "pytest", "-m", "gpu", *(session.posargs or ["-q", "tests/test_gpu.py"]), env=OFFLINE_ENV)


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
    """The main job on the embedded default: every router and dense on CPU, lm-eval, tables and plots (~10 min)."""
    _install(session)
    session.run("python", "-m", "repro", "mini", *session.posargs, env=OFFLINE_ENV)


@nox.session(name="dirmoe-ablation")
def dirmoe_ablation(session: nox.Session) -> None:
    """Why DirMoE collapses on the embedded default: 16 cells (readings, remedies, controls) x 3 seeds x 600 steps on CPU,
    tables and plots in results/dirmoe-ablation/ (cost: README)."""
    _install(session)
    session.run("python", "-m", "repro", "ablation", *session.posargs, env=OFFLINE_ENV)


@nox.session(name="mini-pile")
def mini_pile(session: nox.Session) -> None:
    """Build (or reuse) the embedded mini-pile, its tokenizer and indexed datasets under data/mini-pile."""
    _install(session, "dev")
    session.run("python", "-m", "repro", "data", "mini-pile", "--out", "data/mini-pile", *session.posargs)


@nox.session
def train(session: nox.Session) -> None:
    """Train one experiment: nox -s train -- --experiment dirmoe-tiny --out runs/x [--set schedule.steps=100 ...]."""
    _install(session)
    session.run("python", "-m", "repro", "train", *session.posargs, env=OFFLINE_ENV)


@nox.session
def check(session: nox.Session) -> None:
    """Regression check: nox -s check -- RUN_OR_DIR --against published|PREVIOUS_RUN."""
    _install(session)
    session.run("python", "-m", "repro", "check", *session.posargs, env=OFFLINE_ENV)


# ------------------------------------------------------------------------------------ full scale (GPU)
PILE_TASKS = "arc_challenge,arc_easy,boolq,hellaswag,lambada_openai,piqa,race"


def _scale_args(session: nox.Session, routers_default: str = "all") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"nox -s {session.name} --", description="full-scale run options")
    parser.add_argument(
        "--router", default=routers_default,
        help="comma-separated routers (and dense), or all: every router with experiments "
        "(python -m repro train --list-routers)",
    )
    parser.add_argument("--data", required=True, help="indexed-dataset prefix(es) of tokenized Pile shards, comma-separated")
    parser.add_argument("--tokenizer", default="", help="directory with GPT-2 vocab.json and merges.txt (default: beside the data)")
    parser.add_argument("--gpus", type=int, default=8, help="processes per node for torchrun")
    parser.add_argument("--out", default="runs/pile", help="root of the run directories")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    return parser.parse_args(session.posargs)


def _routers(session: nox.Session, spec: str) -> list[str]:
    """The routers a full-scale session runs: the registry's (asked inside the session's environment) or a list."""
    if spec != "all":
        return [r.strip() for r in spec.split(",") if r.strip()]
    listing = session.run("python", "-m", "repro", "train", "--list-routers", silent=True, env=OFFLINE_ENV)
    return [r for r in listing.split() if r != "megatron"]


def _torchrun_train(session: nox.Session, args: argparse.Namespace, experiment: str, out: str, sets: list[str]) -> None:
    sets = [f"data.source=pile:{args.data}", *([f"data.tokenizer={args.tokenizer}"] if args.tokenizer else []), *sets, *args.set]
    cmd = ["torchrun", f"--nproc_per_node={args.gpus}", "-m", "repro", "train", "--experiment", experiment, "--out", out]
    for item in sets:
        cmd += ["--set", item]
    # A run that started (its config.json exists) is continued: from its newest checkpoint, or from step 0.
    resume = os.path.isfile(os.path.join(out, "config.json"))
    session.run(*cmd, *(["--resume"] if resume else []), env=OFFLINE_ENV)


@nox.session(name="pile-185m")
def pile_185m(session: nox.Session) -> None:
    """LLaMA-185M, E=8, k=1 on The Pile with the papers' settings (60k steps, 30B tokens), then zero-shot lm-eval:
    nox -s pile-185m -- --router dirmoe --data PREFIX --gpus 8 (--router all: every router and dense)."""
    _install(session, "dev,eval,gpu")
    args = _scale_args(session)
    for router in _routers(session, args.router):
        out = f"{args.out}/{router}-185m"
        _torchrun_train(session, args, f"{router}-185m", out, [])
        session.run("python", "-m", "repro", "eval", "--checkpoint", out, "--tasks", PILE_TASKS, "--out", f"{out}/lm_eval.json", env=OFFLINE_ENV)


@nox.session(name="efficiency-185m")
def efficiency_185m(session: nox.Session) -> None:
    """Efficiency only: 300 iterations of LLaMA-185M at the papers' batch (512 x 1024), iteration time and TFLOP/s:
    nox -s efficiency-185m -- --router all --data PREFIX --gpus 8."""
    _install(session, "dev,eval,gpu")
    args = _scale_args(session)
    for router in _routers(session, args.router):
        out = f"{args.out}/efficiency/{router}-185m"
        _torchrun_train(session, args, f"{router}-185m", out, ["schedule.steps=300", "validation.interval=0", "checkpoint.interval=0"])


@nox.session(name="sweep-k")
@nox.parametrize("k", [1, 2, 4])
def sweep_k(session: nox.Session, k: int) -> None:
    """Active experts k in {1, 2, 4}, E=8 (the DirMoE paper's scalability figure: --router dirmoe,switch by default), 10k steps."""
    _install(session, "dev,eval,gpu")
    args = _scale_args(session, routers_default="dirmoe,switch")
    for router in _routers(session, args.router):
        _torchrun_train(session, args, f"{router}-185m", f"{args.out}/sweep-k/{router}-k{k}", [f"model.top_k={k}", "schedule.steps=10000"])


@nox.session(name="sweep-E")
@nox.parametrize("experts", [8, 16, 32])
def sweep_experts(session: nox.Session, experts: int) -> None:
    """Number of experts E in {8, 16, 32} at k=1 (the paper's scalability figure: --router dirmoe,switch by default), 10k steps."""
    _install(session, "dev,eval,gpu")
    args = _scale_args(session, routers_default="dirmoe,switch")
    for router in _routers(session, args.router):
        out = f"{args.out}/sweep-E/{router}-E{experts}"
        _torchrun_train(session, args, f"{router}-185m", out, [f"model.num_experts={experts}", "schedule.steps=10000"])


@nox.session(name="sweep-dirmoe-sparsity")
@nox.parametrize("sparsity_weight", [0.0, 0.001, 0.01, 0.1])
def sweep_dirmoe_sparsity(session: nox.Session, sparsity_weight: float) -> None:
    """DirMoE's expected-k penalty lambda_sparsity (option sparsity_weight) in {0, 1e-3, 1e-2, 1e-1}, 10k steps."""
    _install(session, "dev,eval,gpu")
    args = _scale_args(session, routers_default="dirmoe")
    out = f"{args.out}/sweep-sparsity/dirmoe-ls{sparsity_weight:g}"
    _torchrun_train(session, args, "dirmoe-185m", out, [f"router.options.sparsity_weight={sparsity_weight}", "schedule.steps=10000"])


@nox.session(name="sweep-dirmoe-m")
@nox.parametrize("m", [0.7, 0.8, 0.85, 0.9, 0.95])
def sweep_dirmoe_m(session: nox.Session, m: float) -> None:
    """DirMoE's prior mean mass m (option prior_mass) on the active experts (paper's m x lambda_sparsity heatmap), 10k steps."""
    _install(session, "dev,eval,gpu")
    args = _scale_args(session, routers_default="dirmoe")
    out = f"{args.out}/sweep-m/dirmoe-m{m:g}"
    _torchrun_train(session, args, "dirmoe-185m", out, [f"router.options.prior_mass={m}", "schedule.steps=10000"])


@nox.session(name="sweep-dirmoe-recon")
@nox.parametrize("recon_target", ["raw", "centered"])
def sweep_dirmoe_recon(session: nox.Session, recon_target: str) -> None:
    """DirMoE's reconstruction target (option recon_target) raw (the paper) or centered (the ablation's remedy), 10k steps."""
    _install(session, "dev,eval,gpu")
    args = _scale_args(session, routers_default="dirmoe")
    out = f"{args.out}/sweep-recon/dirmoe-{recon_target}"
    _torchrun_train(session, args, "dirmoe-185m", out, [f"router.options.recon_target={recon_target}", "schedule.steps=10000"])
