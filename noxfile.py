"""One nox session per experiment, plus tests / lint / bench / mini / wheelhouse (``nox --list``).

CPU machines get torch 2.13.0's CPU wheel first (an unpinned torch would pull a multi-GB CUDA build); machines
with ``nvidia-smi`` keep whatever CUDA torch the environment resolves. The full-scale (GPU) sessions never
reinstall torch: their virtualenv sees the launching environment's packages through a ``.pth`` file (why not
``--system-site-packages``: docs/clusters.md); ``--wheelhouse DIR`` installs from that folder alone, ``--extras gpu``
adds TransformerEngine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import site
import sys
import tempfile
from pathlib import Path

import nox

# The command builders live in the package (stdlib + packaging only, so nox's own interpreter can import them).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from repro import wheelhouse as wh  # noqa: E402
from repro.studies import registry as studies  # noqa: E402

nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]

CPU_TORCH = "torch==2.13.0"
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _install(session: nox.Session, extras: str = "dev,eval", wheelhouse: str | None = None) -> None:
    """Install the project (editable) with ``extras``, CPU torch first on CPU machines.

    With ``wheelhouse``, from that folder alone (no index, no CPU torch: the machine's torch is used).
    """
    spec = f".[{extras}]" if extras else "."
    if wheelhouse:
        session.install(*wh.install_args(wheelhouse, spec))
        return
    # pip byte-compiles one file at a time (most of the install); compileall on every core is far quicker. Ahead,
    # not on import: under PYTHONDONTWRITEBYTECODE every process would compile what it imports again.
    if shutil.which("nvidia-smi") is None:
        session.install("--no-compile", CPU_TORCH)
    session.install("--no-compile", "-e", spec)
    # run_install: part of the install (run by --install-only, skipped with the installs by --no-install)
    site = session.run_install("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True)
    if site:
        # exit status 1: files that are not Python 3 (templates, some packages' tests), which pip skips as well
        session.run_install("python", "-m", "compileall", "-qq", "-j", "0", site.strip(), success_codes=[0, 1],
                            silent=True)


#: What ``nox -s tests`` runs without arguments (slow: end-to-end pipelines, long trainings; distributed: torchrun).
QUICK = "not slow and not distributed"


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (CPU) on every core (pytest-xdist, a test file per worker at a time): without arguments
    the quick part (every test not marked slow or distributed); ``-- --all`` everything (what CI runs); other
    arguments go to pytest as given."""
    _install(session, "dev,eval,tensorboard")  # tensorboard: the events test reads them back with its own reader
    args = list(session.posargs) or ["-q", "-m", QUICK]
    if "--all" in args:
        args.remove("--all")
        args = args or ["-q"]
    # --dist loadfile: a file's module-scoped fixtures (trained runs) are built once, in one worker;
    # --no-loadscope-reorder: files go out longest first, as tests/conftest.py orders them. Arguments after --
    # come last (`-- -n 0 tests/test_data.py`: one file serially). Workers: the cores this process may use (a
    # container's CPU set), at most 8 (each holds torch and megatron-core).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    session.run("pytest", "-n", str(max(1, min(cores, 8))), "--dist", "loadfile", "--no-loadscope-reorder", *args,
                env=OFFLINE_ENV)


@nox.session(name="tests-gpu", venv_backend="none")
def tests_gpu(session: nox.Session) -> None:
    """GPU tests (pytest -m gpu) in the current environment: its CUDA torch is used as is, nothing is installed."""
    session.run("python", "-m", "pytest", "-m", "gpu", *(session.posargs or ["-q", "tests/test_gpu.py"]), env=OFFLINE_ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """Router micro-benchmarks (pytest-benchmark): forward+backward at T=4096, D=768, E=8, k=1; JSON in results/bench/."""
    _install(session)
    os.makedirs("results/bench", exist_ok=True)
    session.run("pytest", "benchmarks", "--benchmark-only", "--benchmark-enable",
                "--benchmark-json=results/bench/routers.json", "-p", "no:cacheprovider", *session.posargs,
                env=OFFLINE_ENV)
    session.run("python", "-m", "repro", "report", "bench", "results/bench/routers.json", env=OFFLINE_ENV)
    session.run("python", "-m", "repro", "report", "writeup", env=OFFLINE_ENV)  # results/*/README.md and the README blocks


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the project."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "routers", "baselines", "repro", "tests", "benchmarks", "noxfile.py")


def _cpu_study(session: nox.Session, name: str, out: str, *args: str) -> None:
    """``python -m repro study NAME`` into ``out`` (the committed tables, unless ``--out`` is given), then the
    writeup (results/*/README.md and the README blocks)."""
    _install(session)
    # Told explicitly: a command's own default output is under runs/.
    out_args = [] if "--out" in session.posargs else ["--out", out]
    session.run("python", "-m", "repro", "study", name, *args, *out_args, *session.posargs, env=OFFLINE_ENV)
    session.run("python", "-m", "repro", "report", "writeup", env=OFFLINE_ENV)


@nox.session
def mini(session: nox.Session) -> None:
    """The main job on the embedded default: every router and dense on CPU, lm-eval, tables and plots."""
    _cpu_study(session, "mini", "results/mini")


@nox.session(name="mini-power")
def mini_power(session: nox.Session) -> None:
    """The main job over 10 seeds, for 80% power at the held-out differences the 3-seed study shows (its cost and
    the power at 3, 6 and 10 seeds: results/mini-seeds/README.md); tables in results/mini-power/."""
    _cpu_study(session, "mini", "results/mini-power", "--seeds", "10")


@nox.session(name="dirmoe-ablation")
def dirmoe_ablation(session: nox.Session) -> None:
    """What drives DirMoE's uneven load on the embedded default: 16 cells (readings, remedies, controls) x 3 seeds x 600 steps on CPU,
    tables and plots in results/dirmoe-ablation/ (cost: results/dirmoe-ablation/README.md)."""
    _cpu_study(session, "ablation", "results/dirmoe-ablation")


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
    session.run("python", "-m", "repro", "report", "check", *session.posargs, env=OFFLINE_ENV)


# ------------------------------------------------------------------------------------ offline installs
@nox.session
def wheelhouse(session: nox.Session) -> None:
    """Wheels for an offline machine (no torch/CUDA/TE): nox -s wheelhouse -- --python 3.12 --out wheelhouse [--extras eval]."""
    parser = argparse.ArgumentParser(prog="nox -s wheelhouse --", description="collect the wheels an offline machine needs")
    parser.add_argument("--python", dest="target_python", default="3.12", help="target interpreter MAJOR.MINOR (default 3.12)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64", help="target manylinux tag (default manylinux_2_28_x86_64)")
    parser.add_argument("--out", default="wheelhouse", help="folder to create (must not exist or be empty)")
    parser.add_argument("--extras", default="", help="project extras to cover, comma-separated (eval, dev); default: training only")
    parser.add_argument("--with-nox", action="store_true", help="add nox, to run the nox sessions on the target")
    parser.add_argument("--present", action="append", default=[], metavar="NAME==VERSION",
                        help=f"a package the target already has (never carried); default {wh.DEFAULT_PRESENT}; repeatable")
    parser.add_argument("--present-from", default=None, metavar="FILE", help="the target's pip freeze: all of it is present")
    args = parser.parse_args(session.posargs)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        session.error(f"{out} exists and is not an empty folder: choose another --out")
    extras = [e for e in args.extras.split(",") if e]
    try:
        target = wh.WheelhouseTarget(python=args.target_python, platform=args.platform)
        present = {**wh.DEFAULT_PRESENT,
                   **(wh.parse_present(Path(args.present_from).read_text().splitlines()) if args.present_from else {}),
                   **wh.parse_present(args.present)}
        pyproject = nox.project.load_toml("pyproject.toml")
        roots = wh.project_requirements(pyproject, extras, present, with_nox=args.with_nox)
        # The offline check resolves the requirements on present packages too (torch>=2.6 against 2.11.0).
        check_roots = wh.project_requirements(pyproject, extras, (), with_nox=args.with_nox, drop_excluded=False)
    except (ValueError, OSError) as exc:
        session.error(str(exc))
    session.install("pip>=24.1", "uv>=0.13")
    pip = ("python", "-m", "pip")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside --out and renamed at the end: a failure leaves no partial folder.
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp_name:
        tmp = Path(tmp_name)
        stage, downloads, built_dir, placeholders = tmp / "wheels", tmp / "downloads", tmp / "built", tmp / "present"
        for d in (stage, downloads, built_dir, placeholders):
            d.mkdir()
        for name, lines in (("roots.in", roots), ("check.in", check_roots),
                            ("excludes.txt", sorted({*wh.ALWAYS_EXCLUDED, *present}))):
            (tmp / name).write_text("".join(line + "\n" for line in lines))
        session.run(*wh.uv_compile_command(tmp / "roots.in", tmp / "excludes.txt", tmp / "pins.txt", target))
        pins = wh.parse_pins((tmp / "pins.txt").read_text())
        keep = [(n, v) for n, v in pins if not wh.is_excluded(n, present)]
        left_out = [n for n, _ in pins if wh.is_excluded(n, present)]
        (tmp / "download.txt").write_text("".join(f"{n}=={v}\n" for n, v in keep))
        session.run(*wh.download_command(tmp / "download.txt", downloads, target, pip=pip))
        sdists = sorted(p for p in downloads.iterdir() if wh.is_sdist(p.name))
        if sdists:
            session.run(*wh.build_command(sdists, built_dir, pip=pip))
        built = sorted(built_dir.glob("*.whl"))
        platform_built = [w.name for w in built if not wh.is_pure_wheel(w.name)]
        if platform_built:
            session.error(f"no {target.abi} {target.platform} wheel and not pure Python: {', '.join(platform_built)}; "
                          "build these on a machine like the target and add them to the folder")
        for whl in [*downloads.glob("*.whl"), *built]:
            whl.rename(stage / whl.name)
        have = sorted(wh.distribution_name(w.name) for w in stage.glob("*.whl"))
        if have != sorted(keep):
            session.error(f"the folder does not match the pins: missing {sorted(set(keep) - set(have))}, "
                          f"unexpected {sorted(set(have) - set(keep))}")
        for name, version in present.items():
            wh.placeholder_wheel(name, version, placeholders)
        session.run(*wh.verify_command(tmp / "check.in", [stage, placeholders], tmp / "scratch", target, pip=pip))
        data = wh.manifest(stage, target, extras, roots, present, [w.name for w in built], left_out)
        (stage / "manifest.json").write_text(json.dumps(data, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        stage.rename(out)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.log(f"{out}: {len(data['wheels'])} wheels, {data['total_bytes'] / 2**20:.1f} MiB "
                f"({len(built)} built from sdists); install: pip install {' '.join(wh.install_args(out, spec))}")


# ------------------------------------------------------------------------------------ full scale (GPU)
def _see_launching_env(session: nox.Session) -> None:
    """Let the session's virtualenv see the packages of the environment nox runs in (its CUDA torch): a ``.pth``
    file names them after the virtualenv's own, so the session's installs win and pip never reinstalls torch."""
    out = session.run_install(
        "python", "-c", "import sys, sysconfig; print(sys.version_info[0], sys.version_info[1]); "
        "print(sysconfig.get_paths()['purelib'])", silent=True)
    if not out:  # --no-install on a reused virtualenv: the file is already there
        return
    version, purelib = out.strip().splitlines()[-2:]
    if tuple(map(int, version.split())) != sys.version_info[:2]:
        session.warn(f"the session's Python {version} is not nox's {sys.version_info[:2]}: it will not see nox's packages")
        return
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d) and os.path.realpath(d) != os.path.realpath(purelib)]
    Path(purelib, "_dirmoe_launching_env.pth").write_text("".join(d + "\n" for d in dirs))


def _study(session: nox.Session, name: str, *args: str, extras: str = "") -> None:
    """Install for a full-scale study (torch from the launching environment, the rest from the index or from
    ``--wheelhouse DIR``; ``--extras gpu`` for TransformerEngine) and run ``python -m repro study NAME`` with
    ``args`` and the session's other arguments (``python -m repro study NAME --help``)."""
    parser = argparse.ArgumentParser(prog=f"nox -s {session.name} --", add_help=False)
    parser.add_argument("--wheelhouse", default=None)
    parser.add_argument("--extras", default="")
    known, rest = parser.parse_known_args(session.posargs)
    _see_launching_env(session)
    _install(session, ",".join(e for e in (extras, known.extras) if e), known.wheelhouse)
    session.run("python", "-m", "repro", "study", name, *args, *rest, env=OFFLINE_ENV)


@nox.session(name="efficiency-185m")
def efficiency_185m(session: nox.Session) -> None:
    """Iteration time and TFLOP/s of every router and dense, LLaMA-185M on synthetic tokens at the papers' per-GPU
    batch, with the published rows, on one node: nox -s efficiency-185m -- [--wheelhouse DIR] [--extras gpu]
    [--gpus 8] [--router dirmoe,switch] [--out DIR] (the other options: python -m repro study efficiency --help)."""
    _study(session, "efficiency", "--flavour", "185m", "--published")


def _sweep_session(sweep: studies.Sweep):
    """The nox session of a registered sweep: one session per value of its key (``nox -s 'NAME(<value>)'``, e.g. ``nox -s 'sweep-k(1)'``)."""

    def run(session: nox.Session, value: object = None) -> None:
        _study(session, sweep.name, *([] if value is None else ["--values", str(value)]),
               extras="eval" if sweep.evaluate else "")

    run.__doc__ = f"{sweep.help} (python -m repro study {sweep.name} --help: its options)"
    if sweep.key:
        run = nox.parametrize("value", list(sweep.values), ids=[str(v) for v in sweep.values])(run)
    return nox.session(name=sweep.name)(run)


# One session per registered sweep (pile-185m and the sweeps), from the registry itself.
for _sweep in studies.SWEEPS.values():
    globals()[_sweep.name.replace("-", "_")] = _sweep_session(_sweep)
