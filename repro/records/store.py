"""Building, writing, finding and loading run records (:class:`repro.records.run_record.RunRecord`).

``write_run_record(run_dir)`` builds a finished run's record from ``config.json`` and ``log.jsonl`` into
``record.json``; :func:`load_record` refuses a bad field in one line naming file and field.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from repro.errors import ReproError
from repro.io_utils import write_json_atomic
from repro.records import log_figures as eff
from repro.records.run_record import DomainLoss, Efficiency, Environment, LossPoint, RunRecord, partial_tasks
from repro.records.step_log import LogRow, read_rows
from repro.schema import from_json, to_json

_REPO_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment_info(num_processes: int | None = None, device: str | None = None) -> Environment:
    """This process's environment for a run record.

    Args:
        num_processes: world size (default: torch.distributed's, else ``$WORLD_SIZE`` or 1).
        device: accelerator name (default: CUDA device 0's, else ``cpu (<processor model>)``: float32 results
            differ in their last bits between processor families, which training amplifies).
    """
    import torch

    if num_processes is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        num_processes = torch.distributed.get_world_size() if distributed else int(os.environ.get("WORLD_SIZE", "1"))
    if device is None:
        cpu = f"cpu ({_cpu_model() or platform.processor() or platform.machine()})"
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu
    commit = _git("rev-parse", "HEAD")
    # --no-optional-locks: never refresh the index of the checkout being measured
    status = _git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no") if commit else None
    return Environment(
        git_commit=commit, git_dirty=None if status is None else bool(status), python=platform.python_version(),
        torch=torch.__version__, megatron_core=_version("megatron-core"), lm_eval=_version("lm_eval"),
        device=device, hostname=socket.gethostname(), num_processes=num_processes,
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
    )


def _cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The processor's model name from ``cpuinfo`` (Linux's; None elsewhere, unreadable or without one)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            names = (line.partition(":")[2].strip() for line in f if line.startswith("model name"))
            return next(names, None) or None
    except OSError:
        return None


def make_record(
    *, run_id: str, router: str, model: str, config: Mapping[str, Any], log_rows: Sequence[LogRow] = (),
    efficiency: Efficiency | None = None, lm_eval_results: Mapping[str, Any] | None = None,
    validation_loss: float | None = None, environment: Environment | None = None, experiment_name: str | None = None,
    domain_losses: Sequence[DomainLoss] = (),
) -> RunRecord:
    """Assemble a run record, validated as :func:`load_record` validates a file.

    Args:
        run_id, router, model, config: unique run name; router name or ``"dense"``; flavour; JSON-able config.
        log_rows: training-log rows: loss curve, and routing metrics (averaged over ``efficiency``'s window).
        efficiency: from :func:`repro.records.log_figures.efficiency`.
        lm_eval_results: lm-eval's results dict; ``samples``, if logged, are kept only as ``per_question``.
        validation_loss, domain_losses: held-out LM loss, overall and per domain.
        environment, experiment_name: default :func:`environment_info`, ``run_id``.

    Raises:
        ReproError: a value of the wrong type.
    """
    routing = ()
    if any(r.routing for r in log_rows):
        window = (efficiency.warmup_steps, efficiency.window_steps) if efficiency else (0, None)
        routing = eff.routing(log_rows, warmup=window[0], length=window[1])
    data = {
        "run_id": run_id,
        "experiment": {"name": experiment_name or run_id, "router": router, "model": model, "config": _plain(config)},
        "environment": to_json(environment or environment_info()),
        "loss_curve": to_json(tuple(LossPoint(step=r.step, loss=r.loss) for r in log_rows)),
        "routing": to_json(routing),
        "efficiency": to_json(efficiency),
        "validation_loss": validation_loss,
        **_lm_eval_fields(lm_eval_results),
        "domain_losses": to_json(tuple(domain_losses)),
    }
    # Built through the reader's path, so a record that is made is a record that loads.
    return from_json(RunRecord, data, f"record '{run_id}'")


def _lm_eval_fields(lm_eval_results: Mapping[str, Any] | None) -> dict[str, Any]:
    """The record's ``lm_eval``, ``per_question`` and ``partial`` fields from lm-eval's results."""
    from repro.stats import compact_per_question

    if lm_eval_results is None:
        return {"lm_eval": None, "per_question": None, "partial": []}
    samples = lm_eval_results.get("samples")
    # As lm-eval writes its JSON file (no numpy scalars).
    lm_eval = _plain({k: v for k, v in lm_eval_results.items() if k != "samples"})
    try:
        per_question = compact_per_question(samples) if isinstance(samples, Mapping) else None
    except ValueError as exc:
        raise ReproError(f"lm-eval samples: {exc}") from None
    partial = partial_tasks(lm_eval) if isinstance(lm_eval, Mapping) else ()
    return {"lm_eval": lm_eval, "per_question": per_question or None, "partial": to_json(partial)}


def with_lm_eval(record: RunRecord, lm_eval_results: Mapping[str, Any], origin: str | None = None) -> RunRecord:
    """``record`` with new zero-shot results, per-question results and partial tasks.

    Args:
        lm_eval_results: lm-eval's results dict, with ``samples`` if logged.
        origin: name used in errors (default: the run id).

    Returns:
        The new record, checked like a loaded one.

    Raises:
        ReproError: results out of range, named by field.
    """
    data = {**to_json(record), **_lm_eval_fields(lm_eval_results)}
    return from_json(RunRecord, data, origin or f"record '{record.run_id}'")


def record_from_run_dir(
    run_dir: str | Path, *, warmup: int | None = None, lm_eval_results: Mapping[str, Any] | None = None,
    run_id: str | None = None, environment: Environment | None = None, domain_losses: Sequence[DomainLoss] = (),
    flops_attention: str = "causal", start_step: int | None = None,
) -> RunRecord:
    """A finished run's record from its ``config.json`` and ``log.jsonl`` (validation loss: the last ``val_loss``).

    Args:
        run_dir: the run's output directory.
        warmup: log rows skipped before the efficiency window, the rest (default: a tenth, at least one).
        run_id: default the experiment's name, plus ``-seed<N>`` unless the seed is the registered experiment's.
        environment: default :func:`environment_info` (the run's world size).
        lm_eval_results, domain_losses: as in :func:`make_record`.
        flops_attention: attention FLOPs convention (:data:`repro.records.flops.ATTENTION_COUNTS`).
        start_step: step the weights come from (0: initialisation), recorded with the efficiency figures.

    Returns:
        The :class:`RunRecord` (write it with :func:`write_record`).

    Raises:
        ReproError: missing files or config fields.
    """
    from repro.config import RunConfig
    from repro.experiments import experiment_names, get_experiment
    from repro.records.flops import flops_config_from_flavour

    run_dir = Path(run_dir)
    origin = run_dir / "config.json"
    try:
        config = json.loads(origin.read_text())
        run = RunConfig.from_dict(config["experiment"], origin=str(origin))
        router = run.router.name or "dense"
        flavour = run.model.flavour_config()
        world_size = int(config["layout"]["world_size"])
        flops = flops_config_from_flavour(flavour, vocab_size=config["vocab_size"], tp=int(config["layout"]["tp"]),
                                          attention=flops_attention)
        batch, seq_length = run.data.global_batch_size, int(config["seq_length"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ReproError(f"{origin}: not a training run's config ({type(exc).__name__}: {exc})") from None
    rows = read_rows(run_dir)
    if warmup is None:
        warmup = max(1, len(rows) // 10) if len(rows) > 1 else 0
    efficiency = eff.efficiency(
        rows, warmup=warmup, flops=flops, global_batch_size=batch, seq_length=seq_length,
        num_devices=world_size, mean_active_experts=1.0 if router == "dense" or _merges_experts(router) else None,
        backend=config.get("backend"), start_step=start_step,
    )
    val_losses = [r.val_loss for r in rows if r.val_loss is not None]
    own_seed = get_experiment(run.name).seed if run.name in experiment_names() else None
    return make_record(
        run_id=run_id or (run.name if run.seed == own_seed else f"{run.name}-seed{run.seed}"), router=router,
        model=flavour.name, config=config, log_rows=rows, efficiency=efficiency, lm_eval_results=lm_eval_results,
        domain_losses=domain_losses,
        validation_loss=float(val_losses[-1]) if val_losses else None,
        environment=environment or environment_info(num_processes=world_size), experiment_name=run.name,
    )


def write_run_record(run_dir: str | Path, **options: Any) -> Path:
    """Write ``record.json`` of a finished run: :func:`record_from_run_dir` with ``options`` (keyword arguments)."""
    return write_record(record_from_run_dir(run_dir, **options), Path(run_dir) / "record.json")


def _merges_experts(router: str) -> bool:
    """Whether the router merges expert parameters (Lory); False for names not registered here."""
    import routers

    try:
        return routers.router_class(router).merges_experts
    except ValueError:
        return False


def _plain(obj: Any) -> Any:
    """``obj`` as plain JSON values (numpy / torch scalars to numbers, sets to lists, other objects to strings)."""
    if not isinstance(obj, Mapping):
        return obj  # left for the schema check to refuse
    return json.loads(json.dumps(
        obj, default=lambda o: o.item() if hasattr(o, "item") else list(o) if isinstance(o, set) else str(o)))


def write_record(record: RunRecord, path: str | Path) -> Path:
    """Write ``record`` atomically to ``path`` (usually ``<run dir>/record.json``); return the path."""
    write_json_atomic(path, to_json(record))
    return Path(path)


def load_record(path: str | Path) -> RunRecord:
    """Load and validate one record JSON file; ReproError (one line naming file and field) on unreadable JSON, a
    missing or unknown field, or a wrong type."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ReproError(f"{path}: cannot read record: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ReproError(f"{path}: not a JSON file: {exc.msg} (line {exc.lineno})") from None
    return from_json(RunRecord, data, str(path))


def load_records(paths: Iterable[str | Path]) -> list[RunRecord]:
    """Load record files, and ``record.json`` / ``*.record.json`` found recursively in directories: the records in
    argument order, each directory's sorted by path.

    Raises:
        ReproError: a missing path, a directory without records, a bad record, or a duplicate run_id.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            inside = sorted(p for p in path.rglob("*.json")
                            if p.name == "record.json" or p.name.endswith(".record.json"))
            if not inside:
                raise ReproError(f"{path}: no run records (record.json or *.record.json) in this directory")
            found.extend(inside)
        else:
            raise ReproError(f"{path}: no such file or directory")
    records: list[RunRecord] = []
    origin: dict[str, Path] = {}
    for path in found:
        record = load_record(path)
        if record.run_id in origin:
            raise ReproError(f"{path}: run_id '{record.run_id}' is already used by {origin[record.run_id]}")
        origin[record.run_id] = path
        records.append(record)
    return records
