"""Offline installs and multi-node launch: the wheelhouse's pure logic (what is excluded, the commands
built, pip's treatment of an installed torch), torchrun / sbatch command construction, the SLURM rank
mapping and refusals, and real 2-process gloo rendezvous (torchrun's c10d backend, and srun-style tasks).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import random
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from packaging import tags as packaging_tags
from packaging.utils import canonicalize_name

from repro import launch as rl
from repro import wheelhouse as wh
from repro.cli import main as repro_main
from repro.errors import ReproError
from repro.model.parallel import cuda_device_index, rank_environment

REPO = Path(__file__).resolve().parents[1]
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _free_port() -> int:
    """A free port below the kernel's ephemeral range, so that no port another test's process asks the kernel
    for (torchrun --standalone, any bind to port 0) can take it between this check and its use."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000-32000")


def _communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Wait for every process; as soon as one fails (or the time is up) the others are killed, so a rank left
    waiting for a dead peer never holds the test for the whole timeout."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    return [p.communicate(timeout=60) for p in procs]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.update(extra)
    return env


# ----------------------------------------------------------------------------------------- wheelhouse
@pytest.mark.parametrize("name", ["torch", "Torch", "triton", "nvidia_cublas_cu12", "nvidia-nccl-cu13",
                                  "transformer_engine", "Transformer-Engine-Torch"])
def test_torch_cuda_and_transformer_engine_are_never_carried(name):
    assert wh.is_excluded(name)


def test_present_packages_are_excluded_by_canonical_name():
    assert not wh.is_excluded("numpy")
    assert not wh.is_excluded("megatron-core")
    assert wh.is_excluded("NumPy", present=["numpy"])
    assert wh.is_excluded("huggingface_hub", present=["Huggingface-Hub"])


def test_manylinux_expansion_matches_packaging_on_this_machine():
    """pip matches --platform exactly; the expansion must list what packaging.tags gives a machine of that
    glibc (PEP 600: a manylinux_2_x wheel runs on any glibc >= 2.x), legacy aliases in their places."""
    libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    if not libc.startswith("glibc 2."):
        pytest.skip(f"not a glibc machine ({libc!r})")
    minor = int(libc.split(".")[1])
    machine = [t for t in packaging_tags.platform_tags() if t.startswith("manylinux") and t.endswith("_x86_64")]
    if not machine:
        pytest.skip("not an x86_64 manylinux machine")
    assert wh.manylinux_platforms(f"manylinux_2_{minor}_x86_64") == machine


def test_manylinux_tags_and_target():
    tags = wh.manylinux_platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-1] == "manylinux1_x86_64"
    assert "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags and "manylinux_2_31_x86_64" not in tags
    assert wh.manylinux_platforms("manylinux2014_aarch64")[0] == "manylinux_2_17_aarch64"
    with pytest.raises(ValueError, match="manylinux_2_<minor>_<arch>"):
        wh.manylinux_glibc("linux_x86_64")

    target = wh.WheelhouseTarget()
    assert (target.python, target.abi, target.uv_platform) == ("3.12", "cp312", "x86_64-manylinux_2_28")
    args = target.pip_target_args()
    assert args[:6] == ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
    assert args[6:] == [x for t in tags for x in ("--platform", t)]
    # uv knows only some glibc minors: the newest one not newer than the target's.
    assert wh.WheelhouseTarget(platform="manylinux_2_27_x86_64").uv_platform == "x86_64-manylinux2014"
    assert wh.WheelhouseTarget(python="3.11", platform="manylinux_2_35_x86_64").uv_platform == "x86_64-manylinux_2_35"
    for bad, match in [({"python": "3.12.3"}, "MAJOR.MINOR"), ({"implementation": "pp"}, "CPython"),
                       ({"platform": "manylinux2010_x86_64"}, "older than"), ({"platform": "win_amd64"}, "manylinux")]:
        with pytest.raises(ValueError, match=match):
            wh.WheelhouseTarget(**bad)


def test_parse_present_reads_a_pip_freeze():
    freeze = ["# comment", "", "NumPy==2.5.2", "torch==2.11.0+cu130", "-e git+https://x/y#egg=z",
              "mypkg @ file:///tmp/mypkg", "huggingface_hub==1.33.0  # trailing"]
    assert wh.parse_present(freeze) == {"numpy": "2.5.2", "torch": "2.11.0+cu130", "huggingface-hub": "1.33.0"}
    for bad in ("numpy>=1.26", "numpy", "numpy==2.*", "not a requirement!"):
        with pytest.raises(ValueError, match="NAME==VERSION"):
            wh.parse_present([bad])


def test_project_requirements_from_the_real_pyproject():
    deps = PYPROJECT["project"]["dependencies"]
    train = wh.project_requirements(PYPROJECT)
    assert [r for r in deps if not r.startswith("torch")] == train[: len(deps) - 1]
    assert not any(r.startswith("torch") for r in train)
    assert train[-1] == "setuptools>=68"  # the build backend: an editable install builds the project offline
    assert "lm-eval==0.4.13" in wh.project_requirements(PYPROJECT, ["eval"])
    assert "lm-eval==0.4.13" not in train
    assert "nox>=2024.4" in wh.project_requirements(PYPROJECT, with_nox=True)
    assert not any(r.startswith("numpy") for r in wh.project_requirements(PYPROJECT, present=["numpy"]))
    assert "torch>=2.6" in wh.project_requirements(PYPROJECT, drop_excluded=False)
    with pytest.raises(ValueError, match="source-only"):
        wh.project_requirements(PYPROJECT, ["gpu"])
    with pytest.raises(ValueError, match="unknown extra 'nope'; valid: eval, tensorboard, dev"):
        wh.project_requirements(PYPROJECT, ["nope"])


def test_wheelhouse_commands():
    t = wh.WheelhouseTarget()
    plat = [x for p in t.platforms for x in ("--platform", p)]
    assert wh.uv_compile_command("r.in", "ex.txt", "pins.txt", t) == [
        "uv", "pip", "compile", "r.in", "--python-version", "3.12", "--python-platform", "x86_64-manylinux_2_28",
        "--excludes", "ex.txt", "--no-header", "--no-annotate", "--output-file", "pins.txt"]
    assert wh.download_command("pins.txt", "dl", t, pip=("python", "-m", "pip")) == [
        "python", "-m", "pip", "download", "--no-deps", "--python-version", "3.12", "--implementation", "cp",
        "--abi", "cp312", *plat, "--dest", "dl", "-r", "pins.txt"]
    assert wh.build_command(["a-1.tar.gz", "b-2.zip"], "built") == [
        "pip", "wheel", "--no-deps", "--wheel-dir", "built", "a-1.tar.gz", "b-2.zip"]
    assert wh.verify_command("check.in", ["wh", "ph"], "scratch", t) == [
        "pip", "--isolated", "install", "--dry-run", "--ignore-installed", "--no-index", "--find-links", "wh",
        "--find-links", "ph", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        "--abi", "cp312", *plat, "--target", "scratch", "-r", "check.in"]
    assert wh.install_args("wheelhouse", ".[eval]") == ["--no-index", "--find-links", "wheelhouse", "-e", ".[eval]"]
    assert wh.install_args("wh", "dirmoe-bench", editable=False) == ["--no-index", "--find-links", "wh", "dirmoe-bench"]


def test_parse_pins_and_file_names():
    text = "numpy==2.5.5\n# via x\n    # via y\npython-dateutil==2.9.0-post0\nPyYAML==6.0.3\n"
    assert wh.parse_pins(text) == [("numpy", "2.5.5"), ("python-dateutil", "2.9.0.post0"), ("pyyaml", "6.0.3")]
    with pytest.raises(ValueError, match="not pinned"):
        wh.parse_pins("numpy>=2\n")
    assert wh.is_pure_wheel("tqdm-4.70.1-py3-none-any.whl")
    assert wh.is_pure_wheel("tzdata-2026.6-py2.py3-none-any.whl")
    assert not wh.is_pure_wheel("numpy-2.5.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")
    assert not wh.is_pure_wheel("hf_xet-1.8.0-cp38-abi3-manylinux2014_x86_64.whl")
    assert wh.is_sdist("sqlitedict-2.1.0.tar.gz") and wh.is_sdist("word2number-1.1.zip")
    assert not wh.is_sdist("tqdm-4.70.1-py3-none-any.whl")
    assert wh.distribution_name("PyYAML-6.0.3-cp312-cp312-manylinux2014_x86_64.whl") == ("pyyaml", "6.0.3")
    assert wh.distribution_name("rouge_score-0.1.2.tar.gz") == ("rouge-score", "0.1.2")


def test_manifest_lists_every_wheel_with_size_and_hash(tmp_path):
    a = wh.placeholder_wheel("alpha", "1.0", tmp_path)
    b = wh.placeholder_wheel("beta_pkg", "2.0.post1", tmp_path)
    m = wh.manifest(tmp_path, wh.WheelhouseTarget(), ["eval"], ["alpha"], {"torch": "2.11.0"}, built=[b.name],
                    left_out=["nvidia-nccl-cu13"])
    assert [(w["name"], w["version"], w["built_from_sdist"]) for w in m["wheels"]] == [
        ("alpha", "1.0", False), ("beta-pkg", "2.0.post1", True)]
    for w, path in zip(m["wheels"], (a, b)):
        assert w["bytes"] == path.stat().st_size and w["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert m["total_bytes"] == a.stat().st_size + b.stat().st_size
    assert m["present_on_target"] == {"torch": "2.11.0"} and m["left_out_after_resolution"] == ["nvidia-nccl-cu13"]
    assert m["target"]["python"] == "3.12" and "nvidia-*" in m["excluded_always"]
    json.dumps(m)


def _pip(*args: str, python: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *(["--python", python] if python else []), *args]
    # No PYTHONPATH: a checkout on it (with an editable install's metadata) would look installed.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_offline_install_keeps_the_installed_torch(tmp_path):
    """pip's reference behaviour the wheelhouse relies on: with ``--no-index --find-links``, an installed
    ``torch 2.11.0+cu130`` satisfies ``torch>=2.6`` and stays, even with a newer torch in the folder; a
    requirement the folder cannot meet fails instead of reaching for an index."""
    machine, house = tmp_path / "machine", tmp_path / "house"
    machine.mkdir()
    house.mkdir()
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
    py = str(env_dir / "bin" / "python")
    wh.placeholder_wheel("torch", "2.11.0+cu130", machine)
    proc = _pip("install", "--no-index", "--find-links", str(machine), "torch==2.11.0+cu130", python=py)
    assert proc.returncode == 0, proc.stderr
    wh.placeholder_wheel("torch", "2.13.0", house)  # a newer torch within reach must not replace it
    wh.placeholder_wheel("megatron_core", "0.16.1", house, requires=["torch>=2.6.0", "numpy"])
    wh.placeholder_wheel("numpy", "2.5.5", house)
    wh.placeholder_wheel("offline_project", "0.1.0", house, requires=["torch>=2.6", "megatron-core==0.16.1"])
    proc = _pip("install", "--no-index", "--find-links", str(house), "offline-project", python=py)
    assert proc.returncode == 0, proc.stderr
    site_dirs = list(env_dir.glob("lib/python*/site-packages"))
    versions = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site_dirs)}
    assert versions["torch"] == "2.11.0+cu130"
    assert versions["megatron-core"] == "0.16.1" and versions["numpy"] == "2.5.5"
    wh.placeholder_wheel("needs_more", "1.0", house, requires=["not-in-the-folder>=1"])
    proc = _pip("install", "--no-index", "--find-links", str(house), "needs-more", python=py)
    assert proc.returncode != 0 and "not-in-the-folder" in proc.stderr


# --------------------------------------------------------------------------------------------- launch
def test_torchrun_commands():
    program = ["-m", "repro", "train", "--experiment", "dirmoe-185m"]
    assert rl.torchrun_command(rl.Launch(gpus_per_node=8), program) == [
        "torchrun", "--standalone", "--nproc_per_node=8", *program]
    launch = rl.Launch(nodes=4, gpus_per_node=8, endpoint="gpu01:29500", rdzv_id="run-1")
    assert rl.torchrun_command(launch, program, launcher=("python", "-m", "torch.distributed.run")) == [
        "python", "-m", "torch.distributed.run", "--nnodes=4", "--nproc_per_node=8", "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu01:29500", "--rdzv_id=run-1", "--max_restarts=0", *program]
    assert rl.parse_endpoint("[::1]:29400") == ("[::1]", 29400)


@pytest.mark.parametrize("kwargs, match", [
    ({"nodes": 0}, "nodes must be >= 1"),
    ({"gpus_per_node": 0}, "gpus_per_node must be >= 1"),
    ({"nodes": 2}, "need a rendezvous endpoint"),
    ({"endpoint": "gpu01"}, "HOST:PORT"),
    ({"endpoint": "gpu01:0"}, "1..65535"),
    ({"endpoint": "gpu01:70000"}, "1..65535"),
    ({"endpoint": "a b:29500"}, "HOST:PORT"),
    ({"rdzv_id": "a b"}, "rendezvous id"),
])
def test_launch_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rl.Launch(**kwargs)


SBATCH = """\
#!/bin/bash
#SBATCH --job-name=dirmoe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --output=%x-%j.out
#SBATCH --time=1:00:00
#SBATCH --partition=gpu
# One torchrun per node (srun, one task per node); they meet in a c10d rendezvous on the first node.
# Code, data and checkpoints must be on a filesystem every node sees.
set -eo pipefail
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source /shared/env/bin/activate
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 python -m torch.distributed.run --nnodes=2 \
--nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint="$head_node:29600" --rdzv_id="$SLURM_JOB_ID" \
--max_restarts=0 -m repro train --out 'runs/a b'
srun --nodes=1 --ntasks=1 python -m repro eval --checkpoint 'runs/a b'
"""


def test_sbatch_script_text_and_what_bash_runs(tmp_path):
    job = rl.SlurmJob(nodes=2, gpus_per_node=4, job_name="dirmoe", time="1:00:00", partition="gpu", port=29600,
                      setup=("source /shared/env/bin/activate",), stop_lead_s=None)  # the time-limit part: below
    script = rl.sbatch_script(job, ["train", "--out", "runs/a b"], after=[["eval", "--checkpoint", "runs/a b"]])
    assert script == SBATCH
    # Run it with stand-ins for scontrol and srun: the shell fills the head node and the job id in, and
    # keeps 'runs/a b' one argument.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"scontrol": 'printf "gpu07\\ngpu08\\n"', "srun": 'printf "srun<%s>" "$@"; echo'}.items():
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\n{body}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    runnable = script.replace("source /shared/env/bin/activate", "true")
    proc = subprocess.run(["bash", "-c", runnable], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[07-08]",
                               "SLURM_JOB_ID": "4242"})
    assert proc.returncode == 0, proc.stderr
    srun_line, eval_line = proc.stdout.splitlines()
    assert "srun<--rdzv_endpoint=gpu07:29600>srun<--rdzv_id=4242>" in srun_line
    assert srun_line.endswith("srun<train>srun<--out>srun<runs/a b>")
    assert eval_line == "srun<--nodes=1>srun<--ntasks=1>srun<python>srun<-m>srun<repro>srun<eval>srun<--checkpoint>srun<runs/a b>"


_FAKE_SCONTROL = 'if [ "$1" = requeue ]; then echo "requeue<$2>"; else printf "gpu07\\ngpu08\\n"; fi'
# The training step stands in for srun + torchrun + ranks: on SIGTERM it "checkpoints" and exits 75.
_FAKE_SRUN = (
    'printf "srun<%s>" "$@"; echo\n'
    'case " $* " in *" train "*) trap \'echo stopped-cleanly; exit 75\' TERM; touch "$STARTED"; '
    'i=0; while [ $i -lt ${TICKS:-100} ]; do sleep 0.1; i=$((i+1)); done;; esac'
)


def _slurm_tools(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"scontrol": _FAKE_SCONTROL, "srun": _FAKE_SRUN}.items():
        tool = bin_dir / name
        tool.write_text(f"#!/bin/bash\n{body}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "4242", "STARTED": str(tmp_path / "started")}


def test_slurm_time_limit_stops_requeues_and_resumes(tmp_path):
    """USR1 ahead of the limit: the shell passes SIGTERM to the training step, requeues the job instead of running
    the evaluation, and the requeued job (SLURM_RESTART_COUNT) trains with --resume."""
    import signal
    import time

    job = rl.SlurmJob(nodes=2, gpus_per_node=4, time="1:00:00", stop_lead_s=240)
    script = rl.sbatch_script(job, ["train", "--out", "runs/x"], after=[["eval", "--checkpoint", "runs/x"]])
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert {"#SBATCH --signal=B:USR1@240", "#SBATCH --requeue", "#SBATCH --open-mode=append"} <= set(header)
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=240" in script
    # only a train command stops and requeues; --stop-lead 0 turns it off
    assert "--signal" not in rl.sbatch_script(job, ["eval", "--checkpoint", "runs/x"])
    assert "--signal" not in rl.sbatch_script(rl.SlurmJob(nodes=1, stop_lead_s=None), ["train"])

    env = _slurm_tools(tmp_path)
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 20
    while not Path(env["STARTED"]).exists():
        # past the deadline the script is killed before its output is read: never a wait without end
        assert time.monotonic() < deadline and proc.poll() is None, (proc.kill(), proc.communicate(timeout=20))
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@240 delivers to the batch shell
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[-2:] == ["stopped-cleanly", "requeue<4242>"], out
    assert "--resume" not in lines[0] and not any("eval" in line for line in lines), out
    assert "requeueing job 4242" in err

    # the requeued job resumes, and with the run finished the evaluation follows
    Path(env["STARTED"]).unlink()
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={**env, "SLURM_RESTART_COUNT": "1", "TICKS": "0"})
    assert proc.returncode == 0, proc.stderr
    train_line, eval_line = proc.stdout.splitlines()
    assert train_line.endswith("srun<train>srun<--out>srun<runs/x>srun<--resume>")
    assert "srun<eval>" in eval_line


def test_slurm_job_validation():
    with pytest.raises(ValueError, match="job_name"):
        rl.SlurmJob(nodes=2, job_name="two words")
    with pytest.raises(ValueError, match="newline"):
        rl.SlurmJob(nodes=2, setup=("a\nb",))
    with pytest.raises(ValueError, match="1..65535"):
        rl.SlurmJob(nodes=2, port=0)


def test_launch_command_line(capsys):
    assert repro_main(["launch", "--nodes", "2", "--gpus", "4", "--rdzv-endpoint", "gpu01:29500", "--rdzv-id", "r1",
                       "--", "train", "--experiment", "dirmoe-185m", "--out", "runs/a b"]) == 0
    assert capsys.readouterr().out == (
        "python -m torch.distributed.run --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d "
        "--rdzv_endpoint=gpu01:29500 --rdzv_id=r1 --max_restarts=0 -m repro train --experiment dirmoe-185m "
        "--out 'runs/a b'\n")
    assert repro_main(["launch", "--slurm", "--nodes", "2", "--gpus", "4", "--then", "eval --checkpoint runs/x",
                       "--", "train", "--out", "runs/x"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and out.endswith("\nsrun --nodes=1 --ntasks=1 python -m repro eval --checkpoint runs/x\n")
    for argv, message in [
        (["launch", "--nodes", "2"], "give the repro command after '--'"),
        (["launch", "--nodes", "2", "--", "train"], "need a rendezvous endpoint"),
        (["launch", "--slurm", "--nodes", "2", "--rdzv-endpoint", "h:1", "--", "train"], "drop --rdzv-endpoint"),
        (["launch", "--then", "eval", "--", "train"], "belong to --slurm"),
        (["launch", "--", "launch"], "cannot be launched"),
    ]:
        assert repro_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)


# ------------------------------------------------------------------------------------ rank variables
def _no_hosts(nodelist: str) -> list[str]:
    raise AssertionError(f"hostnames looked up for {nodelist}")


def test_rank_environment_torchrun_and_single_process():
    assert rank_environment({"RANK": "3", "WORLD_SIZE": "8", "SLURM_NTASKS": "2"}, _no_hosts) == {}
    assert rank_environment({}, _no_hosts) == {}
    # One srun task (or a batch script of one task) is a one-process run.
    assert rank_environment({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, _no_hosts) == {}
    assert rank_environment({"SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, _no_hosts) == {}
    assert rank_environment({"OMPI_COMM_WORLD_SIZE": "1"}, _no_hosts) == {}


def test_rank_environment_maps_srun_tasks():
    seen = []

    def hosts(nodelist: str) -> list[str]:
        seen.append(nodelist)
        return ["gpu03", "gpu04"]

    env = {"SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_JOB_NODELIST": "gpu[01-08]", "SLURM_JOB_ID": "1234567"}
    assert rank_environment(env, hosts) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
                                            "MASTER_ADDR": "gpu03", "MASTER_PORT": str(15000 + 4567)}
    assert seen == ["gpu[03-04]"]  # the step's nodes: task 0 runs on the first of them
    kept = rank_environment({**env, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "23456"}, _no_hosts)
    assert kept == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}
    no_step_list = {k: v for k, v in env.items() if k != "SLURM_STEP_NODELIST" and k != "SLURM_JOB_ID"}
    assert rank_environment(no_step_list, lambda nl: [nl.split("[")[0] + "01"]) == {
        "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu01", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, match", [
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, "SLURM_NTASKS=4 but this process was not started by srun"),
    ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0"}, "cannot tell this task's rank"),
    ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}, "cannot tell"),
    ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}, "export MASTER_ADDR"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=4: started by an MPI launcher"),
    ({"PMI_SIZE": "2"}, "PMI_SIZE=2"),
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not an integer"),
])
def test_rank_environment_refuses_launches_it_cannot_place(env, match):
    with pytest.raises(ReproError, match=match):
        rank_environment(env, _no_hosts)


def test_cuda_device_index():
    assert cuda_device_index(3, 8) == 3
    assert cuda_device_index(5, 1) == 0  # srun --gpus-per-task=1: each task sees its own GPU as device 0
    with pytest.raises(ReproError, match="more processes than GPUs"):
        cuda_device_index(4, 2)


def test_training_refuses_a_batch_script_of_several_tasks(tmp_path, monkeypatch, capsys):
    """A batch script with --ntasks=4 running the command directly (not under srun) must not train alone."""
    env = _clean_env(SLURM_NTASKS="4", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_JOB_ID="77")
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    assert repro_main(["train", "--experiment", "dirmoe-tiny", "--out", str(out), "--no-progress",
                       "--set", "data.source=synthetic", "--set", "schedule.steps=1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and "SLURM_NTASKS=4 but this process was not started by srun" in errors[0]
    assert not out.exists()


# ------------------------------------------------------------------------- real rendezvous (gloo, CPU)
_WORKER = textwrap.dedent("""
    import os, sys, warnings
    from pathlib import Path
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from repro.model.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp=1, ep=1, seed=1)
    x = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(x)
    # One file per rank: ranks launched by torchrun share one stdout, whose lines may interleave.
    line = f"RANK-OK {info.rank}/{info.world_size} local={info.local_rank} env={os.environ['RANK']} sum={x.item():g}"
    (Path(sys.argv[1]) / f"rank{info.rank}.txt").write_text(line)
    destroy_distributed()
""")


@pytest.mark.distributed
def test_c10d_rendezvous_two_processes(tmp_path):
    """The command the suite builds for --nodes with an endpoint, run for real: torchrun's c10d
    rendezvous on localhost, two gloo ranks, init_distributed and an all-reduce."""
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    launch = rl.Launch(nodes=1, gpus_per_node=2, endpoint=f"localhost:{_free_port()}", rdzv_id="test-c10d")
    cmd = rl.torchrun_command(launch, [str(worker), str(tmp_path)],
                              launcher=(sys.executable, "-m", "torch.distributed.run"))
    assert "--rdzv_backend=c10d" in cmd
    proc = subprocess.run(cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == [
        "RANK-OK 0/2 local=0 env=0 sum=3", "RANK-OK 1/2 local=1 env=1 sum=3"]


@pytest.mark.distributed
def test_srun_style_tasks_find_each_other(tmp_path):
    """Two tasks started the way ``srun --ntasks=2`` starts them (SLURM variables only, no RANK/WORLD_SIZE,
    no MASTER_ADDR): the ranks come from SLURM_PROCID, the head node from ``scontrol show hostnames``."""
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[1-2]" ] && printf "localhost\\nnode2\\n"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = _clean_env(SLURM_JOB_ID="90000", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(rank),
                         SLURM_LOCALID=str(rank), SLURM_STEP_NODELIST="node[1-2]", MASTER_PORT=str(port),
                         PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        procs.append(subprocess.Popen([sys.executable, str(worker), str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = _communicate_all(procs, timeout=600)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == [
        "RANK-OK 0/2 local=0 env=0 sum=3", "RANK-OK 1/2 local=1 env=1 sum=3"]
