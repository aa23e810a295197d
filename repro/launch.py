"""Multi-node launch: torchrun with c10d rendezvous, SLURM batch scripts, ``python -m repro launch``.

Pure stdlib functions (``noxfile.py`` imports it without torch; docs/clusters.md). As torchtitan and Megatron-LM
(DESIGN.md 9): one ``torchrun`` per node, elastic c10d rendezvous (no node ranks, any start order).

Defaults the references leave open: (1) rendezvous port 29500; (2) ``srun --kill-on-bad-exit=1``, so a failed
node ends the step rather than others waiting for the NCCL timeout; (3) ``--max_restarts=0``: resuming is an
explicit ``--resume``; (4) ``train`` checkpoints, stops and requeues 300 s before the time limit.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from repro.schema import check_minimums

_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")
_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) -> ``(host, port)``; a ValueError for anything else."""
    m = _ENDPOINT_RE.match(endpoint)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"rendezvous endpoint '{endpoint}' must be HOST:PORT with a port in 1..65535")
    return m.group(1), int(m.group(2))


@dataclass(frozen=True)
class Launch:
    """How many processes, where, and how they meet.

    Args:
        nodes, gpus_per_node: torchrun ``--nnodes``, ``--nproc_per_node``.
        endpoint: c10d rendezvous ``HOST:PORT`` all nodes reach; required above one node (else ``--standalone``).
        rdzv_id: rendezvous id, the same on every node, unique per concurrent job.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    endpoint: str | None = None
    rdzv_id: str = "dirmoe-bench"

    def __post_init__(self) -> None:
        check_minimums(self, nodes=1, gpus_per_node=1)
        if self.endpoint is not None:
            parse_endpoint(self.endpoint)
        elif self.nodes > 1:
            raise ValueError(f"{self.nodes} nodes need a rendezvous endpoint HOST:PORT that every node reaches")
        if not _ID_RE.match(self.rdzv_id):
            raise ValueError(f"rendezvous id '{self.rdzv_id}' may hold only letters, digits, '.', '_' and '-'")


def torchrun_args(launch: Launch) -> list[str]:
    """torchrun's options for ``launch``."""
    if launch.endpoint is None:
        return ["--standalone", f"--nproc_per_node={launch.gpus_per_node}"]
    return [f"--nnodes={launch.nodes}", f"--nproc_per_node={launch.gpus_per_node}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={launch.endpoint}", f"--rdzv_id={launch.rdzv_id}", "--max_restarts=0"]


def torchrun_command(launch: Launch, program: Sequence[str], launcher: Sequence[str] = ("torchrun",)) -> list[str]:
    """The command each node runs: ``launcher``, its options for ``launch``, then ``program``."""
    return [*launcher, *torchrun_args(launch), *program]


@dataclass(frozen=True)
class SlurmJob:
    """A SLURM batch job running one torchrun per node.

    Args:
        nodes, gpus_per_node: nodes to allocate; GPUs per node, one process each.
        job_name, time, partition, account, output: the ``#SBATCH`` options (None: SLURM's default).
        port, python: rendezvous port on the head node; interpreter on the nodes.
        setup: shell lines run on the batch host before the step; srun passes the environment to every node.
        stop_lead_s: ``train`` only: seconds before the time limit to checkpoint, stop and requeue (None: never).
    """

    nodes: int
    gpus_per_node: int = 8
    job_name: str = "dirmoe-bench"
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    port: int = 29500
    python: str = "python"
    setup: tuple[str, ...] = ()
    output: str = "%x-%j.out"
    stop_lead_s: int | None = 300

    def __post_init__(self) -> None:
        Launch(nodes=self.nodes, gpus_per_node=self.gpus_per_node, endpoint=f"head:{self.port}")
        check_minimums(self, stop_lead_s=1)  # None: never
        for key in ("job_name", "time", "partition", "account", "output"):
            value = getattr(self, key)
            if value is not None and (not value or any(c.isspace() for c in value)):
                raise ValueError(f"slurm {key} '{value}' must be non-empty without spaces")
        for line in self.setup:
            if "\n" in line:
                raise ValueError(f"setup line {line!r} holds a newline; give one line per --setup")


def sbatch_script(job: SlurmJob, program: Sequence[str], after: Sequence[Sequence[str]] = ()) -> str:
    """A batch script: one ``srun`` task per node, each a torchrun joining a c10d rendezvous on the head node.

    Args:
        job: the allocation and environment.
        program: the ``python -m repro`` arguments torchrun starts (``["train", ...]``).
        after: ``python -m repro`` commands run once each as one-task steps after training succeeds.

    Returns:
        The script text (``set -eo pipefail``; no ``-u``: activation scripts may read unset variables).

    With ``job.stop_lead_s``, ``train`` survives the time limit: on USR1 the shell SIGTERMs every rank, which
    checkpoints and exits 75 (:mod:`repro.training.preemption`); the job requeues, skipping ``after``, and resumes.
    """
    q = shlex.quote
    stoppable = job.stop_lead_s is not None and program[:1] == ["train"]
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={job.gpus_per_node}",
        f"#SBATCH --output={job.output}",
        *(f"#SBATCH --{key}={value}" for key, value in
          (("time", job.time), ("partition", job.partition), ("account", job.account)) if value),
        *([f"#SBATCH --signal=B:USR1@{job.stop_lead_s}", "#SBATCH --requeue", "#SBATCH --open-mode=append"]
          if stoppable else []),
        "# One torchrun per node (srun, one task per node); they meet in a c10d rendezvous on the first node.",
        "# Code, data and checkpoints must be on a filesystem every node sees.",
        "set -eo pipefail",
        "export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false",
        *job.setup,
        # sed, not `head -n1`: an early-closed pipe SIGPIPEs scontrol and pipefail ends the script.
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
    ]
    # Endpoint and id become shell variables, filled in on the node.
    launch = Launch(nodes=job.nodes, gpus_per_node=job.gpus_per_node, endpoint=f"head:{job.port}", rdzv_id="job")
    shell = {f"--rdzv_endpoint=head:{job.port}": f'--rdzv_endpoint="$head_node:{job.port}"',
             "--rdzv_id=job": '--rdzv_id="$SLURM_JOB_ID"'}
    options = [shell.get(arg, q(arg)) for arg in torchrun_args(launch)]
    srun = (f"srun --nodes={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 {q(job.python)} -m torch.distributed.run "
            + " ".join(options) + " -m repro " + " ".join(map(q, program)))
    lines = header + ([
        f"# USR1 {job.stop_lead_s} s before the time limit: every rank finishes its step, checkpoints and exits (75);",
        "# the job is requeued and, requeued, resumes from that checkpoint.",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={job.stop_lead_s}",
        "stop_requested=0",
        'trap \'stop_requested=1; kill -TERM "$train_pid" 2>/dev/null || true\' USR1',
        "resume=()",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume=(--resume); fi',
        srun + ' "${resume[@]}" &',
        "train_pid=$!",
        "status=0",
        'wait "$train_pid" || status=$?',
        'while kill -0 "$train_pid" 2>/dev/null; do status=0; wait "$train_pid" || status=$?; done',
        'if [ "$stop_requested" = 1 ]; then',
        '    echo "stopped ahead of the time limit: requeueing job $SLURM_JOB_ID to resume" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        '[ "$status" -eq 0 ] || exit "$status"',
    ] if stoppable else [srun])
    # One-task steps: the batch environment's SLURM_NTASKS=nodes would make init_distributed refuse.
    lines += [f"srun --nodes=1 --ntasks=1 {q(job.python)} -m repro " + " ".join(map(q, cmd)) for cmd in after]
    return "\n".join(lines) + "\n"


def main(argv: list[str], prog: str = "python -m repro launch") -> int:
    """``python -m repro launch [options] -- COMMAND ...``: print (or ``--run``) a repro command's launch.

    Returns:
        0, or torchrun's exit status with ``--run``.
    """
    import argparse
    import subprocess

    from repro.errors import ReproError

    program: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, program = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print the torchrun command (or SLURM batch script) that runs a repro command on N nodes x G GPUs.",
        epilog="example: python -m repro launch --slurm --nodes 4 --gpus 8 -- train --experiment dirmoe-185m "
               "--out runs/pile/dirmoe-185m --set data.source=pile:data/pile/pile > job.sbatch",
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--gpus", type=int, default=8, help="processes (GPUs) per node (default 8)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="c10d rendezvous endpoint: one of the nodes, reachable from all (needed for --nodes > 1 without --slurm)")
    parser.add_argument("--rdzv-id", default="dirmoe-bench", help="rendezvous id, the same on every node")
    parser.add_argument("--python", default="python", help="interpreter on the nodes (default: python)")
    parser.add_argument("--run", action="store_true", help="run the torchrun command here instead of printing it")
    slurm = parser.add_argument_group("SLURM (--slurm prints a batch script)")
    slurm.add_argument("--slurm", action="store_true", help="print an sbatch script: srun, one torchrun per node")
    slurm.add_argument("--job-name", default="dirmoe-bench")
    slurm.add_argument("--time", default=None, help="time limit, e.g. 2-00:00:00")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--account", default=None)
    slurm.add_argument("--port", type=int, default=29500, help="rendezvous port on the head node (default 29500)")
    slurm.add_argument("--stop-lead", type=int, default=300, metavar="SECONDS",
                       help="train: checkpoint, stop and requeue this long before the time limit (default 300; 0: never)")
    slurm.add_argument("--setup", action="append", default=[], metavar="LINE",
                       help="shell line run before the step (e.g. 'source .venv/bin/activate'); repeatable")
    slurm.add_argument("--then", action="append", default=[], metavar="COMMAND",
                       help="a repro command run once after training, e.g. 'eval --checkpoint RUN --tasks ... "
                            "--out RUN/lm_eval.json'; repeatable")
    args = parser.parse_args(argv)
    if not program:
        raise ReproError("give the repro command after '--', e.g. -- train --experiment dirmoe-185m --out runs/x")
    if program[0] in ("launch", "study"):
        raise ReproError(f"'{program[0]}' cannot be launched under torchrun; give train (or another per-rank command)")
    try:
        if args.slurm:
            if args.run:
                raise ReproError("--run and --slurm exclude each other: submit the script with sbatch")
            if args.rdzv_endpoint:
                raise ReproError("--slurm takes the rendezvous host from the allocation; drop --rdzv-endpoint (use --port)")
            job = SlurmJob(nodes=args.nodes, gpus_per_node=args.gpus, job_name=args.job_name, time=args.time,
                           partition=args.partition, account=args.account, port=args.port, python=args.python,
                           setup=tuple(args.setup), stop_lead_s=args.stop_lead or None)
        elif args.then or args.setup:
            raise ReproError("--then and --setup belong to --slurm; without it run each command yourself")
        else:
            launch = Launch(nodes=args.nodes, gpus_per_node=args.gpus, endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    except ValueError as exc:
        raise ReproError(str(exc)) from None
    if args.slurm:
        print(sbatch_script(job, program, [shlex.split(cmd) for cmd in args.then]), end="")
        return 0
    cmd = torchrun_command(launch, ["-m", "repro", *program], launcher=(args.python, "-m", "torch.distributed.run"))
    if not args.run:
        print(shlex.join(cmd))
        return 0
    return subprocess.run(cmd, check=False).returncode
