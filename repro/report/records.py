"""The run record: one JSON file per run holding everything the tables and checks read.

A record holds the experiment config, the environment, the loss curve, per-layer routing metrics, the
efficiency figures and lm-eval's results dict exactly as lm-eval returns it. It is a frozen dataclass
(:class:`RunRecord`); :func:`load_record` refuses a file with a missing field, an unknown field or a wrong
type with one line naming the file and the field, and :func:`write_record` writes atomically.

The pipeline builds a record from a training run's output directory with::

    record = record_from_run_dir(out_dir, warmup=10, lm_eval_results=results)
    write_record(record, out_dir / "record.json")

or piece by piece::

    rows = read_log_jsonl(out_dir / "log.jsonl")
    eff = efficiency_from_log(rows, warmup=10, flops=cfg, global_batch_size=B, seq_length=s, num_devices=n)
    rec = make_record(run_id="mini-dirmoe", router="dirmoe", model="tiny", config=config_dict,
                      log_rows=rows, efficiency=eff, lm_eval_results=results)
    write_record(rec, out_dir / "record.json")

File naming: a run's record is ``record.json`` (in its run directory) or ``<name>.record.json``;
:func:`find_records` looks for those names under a directory.

Per-step log rows (``log.jsonl``, written by the training loop) are read for: ``step``, ``loss``,
``iter_time_s``, ``tokens_per_s``, optionally ``peak_memory_bytes``, and per-layer routing metrics
(``active_experts``, ``simpson``, ``load_imbalance``, ``dropped_mass``) as the training loop writes them:
one list per metric, index = MoE layer, at the top level or under ``"router_metrics"``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from repro.errors import ReproError
from repro.io_utils import write_json_atomic
from repro.report.flops import (
    FlopsConfig,
    analytic_flops_per_iteration,
    expert_flops_per_token,
    measured_flops_per_iteration,
    tflops_per_device,
)
from repro.report.schema import from_json, to_json

SCHEMA = "dirmoe-bench/run-record"
SCHEMA_VERSION = 1
ROUTING_METRICS = ("active_experts", "simpson", "load_imbalance", "dropped_mass")
_ALIASES = {"simpson_index": "simpson"}
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Experiment:
    """What was run.

    Args:
        name: the experiment's name (e.g. the nox session or config name).
        router: registered router name, or ``"dense"``.
        model: model flavour (``"llama-185m"``, ``"tiny"``); published numbers are matched on it.
        config: the full experiment config as the training code wrote it (``config.json``).
    """

    name: str
    router: str
    model: str
    config: dict[str, Any]


@dataclass(frozen=True)
class Environment:
    """Where it was run (see :func:`environment_info`).

    Args:
        git_commit: ``git rev-parse HEAD`` of the suite, None outside a checkout.
        git_dirty: whether tracked files had uncommitted changes.
        python: Python version.
        torch: torch version.
        megatron_core: megatron-core version, None if not installed.
        lm_eval: lm-eval version, None if not installed.
        device: accelerator name (``NVIDIA H100 80GB HBM3``) or ``cpu (...)``.
        hostname: the machine.
        num_processes: processes in the run (world size).
        platform: OS and architecture.
    """

    git_commit: str | None
    git_dirty: bool | None
    python: str
    torch: str
    megatron_core: str | None
    lm_eval: str | None
    device: str
    hostname: str
    num_processes: int
    platform: str


@dataclass(frozen=True)
class LossPoint:
    """One point of the training loss curve."""

    step: int
    loss: float


@dataclass(frozen=True)
class LayerRouting:
    """Routing metrics of one MoE layer, averaged over the measurement window (None: not reported).

    Args:
        layer: layer index.
        active_experts: mean experts per token.
        simpson: mean Simpson index sum_i p_i^2 of the combine weights.
        load_imbalance: max / mean tokens per expert.
        dropped_mass: routing-weight mass the dispatch rule dropped.
    """

    layer: int
    active_experts: float | None
    simpson: float | None
    load_imbalance: float | None
    dropped_mass: float | None


@dataclass(frozen=True)
class Efficiency:
    """Training efficiency over a window of steps after warm-up (see :func:`efficiency_from_log`).

    Args:
        warmup_steps: log rows skipped before the window.
        window_steps: log rows in the window.
        iter_time_ms: median iteration time.
        tokens_per_s: median tokens per second (all devices).
        peak_memory_bytes: peak memory per device (allocated CUDA memory on GPU, process peak RSS on CPU),
            None where not logged.
        num_devices: devices sharing an iteration.
        global_batch_size: sequences per iteration.
        seq_length: tokens per sequence.
        nominal_experts: the nominal k.
        mean_active_experts: measured mean experts per token over layers (None where unknown).
        flops_per_iter_analytic: Megatron-LM model FLOPs at the nominal k.
        flops_per_iter_measured: the same at the measured k.
        tflops_per_device_analytic: achieved TFLOP/s per device, analytic FLOPs.
        tflops_per_device_measured: achieved TFLOP/s per device, measured FLOPs.
        expert_flops_per_token_measured: expert (FFN) FLOPs per token at the measured k: compute parity.
    """

    warmup_steps: int
    window_steps: int
    iter_time_ms: float
    tokens_per_s: float
    peak_memory_bytes: int | None
    num_devices: int
    global_batch_size: int
    seq_length: int
    nominal_experts: float
    mean_active_experts: float | None
    flops_per_iter_analytic: float
    flops_per_iter_measured: float | None
    tflops_per_device_analytic: float
    tflops_per_device_measured: float | None
    expert_flops_per_token_measured: float | None


@dataclass(frozen=True)
class RunRecord:
    """One run, as written to ``record.json``.

    Args:
        run_id: unique name of the run.
        experiment: see :class:`Experiment`.
        environment: see :class:`Environment`.
        loss_curve: training loss per logged step.
        routing: per-layer routing metrics (empty for a dense model).
        efficiency: see :class:`Efficiency` (None if not measured).
        validation_loss: held-out LM loss at the end, None if not measured.
        lm_eval: lm-eval's results dict as lm-eval returns it (``results``, ``configs``, ...), None if the
            run was not evaluated.
        schema: always ``dirmoe-bench/run-record``.
        schema_version: the record layout version.
    """

    run_id: str
    experiment: Experiment
    environment: Environment
    loss_curve: tuple[LossPoint, ...]
    routing: tuple[LayerRouting, ...]
    efficiency: Efficiency | None
    validation_loss: float | None
    lm_eval: dict[str, Any] | None
    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema != SCHEMA:
            raise ValueError(f"field 'schema' must be '{SCHEMA}', got '{self.schema}'")
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"field 'schema_version' must be {SCHEMA_VERSION}, got {self.schema_version}")
        if self.lm_eval is not None:
            results = self.lm_eval.get("results")
            if not isinstance(results, dict) or not all(isinstance(v, dict) for v in results.values()):
                raise ValueError("field 'lm_eval.results' must be an object of per-task objects (lm-eval's layout)")


# ------------------------------------------------------------------------------------------ environment
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment_info(num_processes: int | None = None, device: str | None = None) -> Environment:
    """Describe this process's environment for a run record.

    Args:
        num_processes: world size; default: torch.distributed's if initialised, else ``$WORLD_SIZE`` or 1.
        device: accelerator name; default: CUDA device 0's name, else ``cpu (<processor>)``.

    Returns:
        An :class:`Environment`.
    """
    import torch

    if num_processes is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            num_processes = torch.distributed.get_world_size()
        else:
            num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if device is None:
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name(0)
        else:
            device = f"cpu ({platform.processor() or platform.machine()})"
    commit = _git("rev-parse", "HEAD")
    # --no-optional-locks: read-only, never refreshes the index of the checkout being measured
    status = _git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no") if commit else None
    return Environment(
        git_commit=commit,
        git_dirty=None if status is None else bool(status),
        python=platform.python_version(),
        torch=torch.__version__,
        megatron_core=_version("megatron-core"),
        lm_eval=_version("lm_eval"),
        device=device,
        hostname=socket.gethostname(),
        num_processes=num_processes,
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
    )


# ------------------------------------------------------------------------------------------ log rows
def read_log_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a training log, one JSON object per line.

    Args:
        path: ``log.jsonl``.

    Returns:
        The rows in file order (blank lines skipped).

    Raises:
        ReproError: unreadable file or a line that is not a JSON object (named by line number).
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ReproError(f"{path}: cannot read log: {exc.strerror or exc}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReproError(f"{path}:{number}: not JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise ReproError(f"{path}:{number}: a log row must be a JSON object")
        rows.append(row)
    return rows


def loss_curve_from_log(rows: Iterable[Mapping[str, Any]]) -> tuple[LossPoint, ...]:
    """The (step, loss) curve of a training log.

    Args:
        rows: log rows with ``step`` and ``loss``.

    Returns:
        One :class:`LossPoint` per row that has both.
    """
    return tuple(
        LossPoint(step=int(r["step"]), loss=float(r["loss"]))
        for r in rows
        if r.get("step") is not None and r.get("loss") is not None
    )


def _layer_metrics(row: Mapping[str, Any]) -> dict[int, dict[str, float]]:
    """Per-layer routing metrics of one log row (one list per metric, index = MoE layer)."""
    found: dict[int, dict[str, float]] = {}

    def put(layer: int, name: str, value: Any) -> None:
        name = _ALIASES.get(name, name)
        if name in ROUTING_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool):
            found.setdefault(layer, {})[name] = float(value)

    for source in (row, row.get("router_metrics")):
        if isinstance(source, Mapping):
            for name, values in source.items():
                if isinstance(values, list):
                    for layer, value in enumerate(values):
                        put(layer, name, value)
    return found


def _window(rows: Sequence[Mapping[str, Any]], warmup: int, window: int | None) -> Sequence[Mapping[str, Any]]:
    if warmup < 0 or (window is not None and window < 1):
        raise ReproError(f"need warmup >= 0 and window >= 1, got warmup={warmup}, window={window}")
    selected = rows[warmup:] if window is None else rows[warmup : warmup + window]
    if not selected:
        raise ReproError(f"the log has {len(rows)} steps and warm-up skips {warmup}: no steps left to measure")
    return selected


def routing_from_log(
    rows: Sequence[Mapping[str, Any]], *, warmup: int = 0, window: int | None = None
) -> tuple[LayerRouting, ...]:
    """Per-layer routing metrics averaged over the rows of a window after warm-up.

    Args:
        rows: training-log rows (module docstring lists the accepted shapes of the routing metrics).
        warmup: rows skipped at the start.
        window: rows averaged after the warm-up (None: all the rest).

    Returns:
        One :class:`LayerRouting` per layer seen, by layer index; empty when no row has routing metrics.
    """
    seen: dict[int, dict[str, list[float]]] = {}
    for row in _window(rows, warmup, window):
        for layer, metrics in _layer_metrics(row).items():
            for name, value in metrics.items():
                seen.setdefault(layer, {}).setdefault(name, []).append(value)
    layers = []
    for layer in sorted(seen):
        means = {name: statistics.fmean(seen[layer][name]) if name in seen[layer] else None for name in ROUTING_METRICS}
        layers.append(LayerRouting(layer=layer, **means))
    return tuple(layers)


def _column(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    values = []
    for row in rows:
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ReproError(f"log row at step {row.get('step', '?')}: '{key}' must be a finite number, got {value!r}")
        values.append(float(value))
    return values


def efficiency_from_log(
    rows: Sequence[Mapping[str, Any]],
    *,
    warmup: int,
    flops: FlopsConfig,
    global_batch_size: int,
    seq_length: int,
    num_devices: int = 1,
    window: int | None = None,
    peak_memory_bytes: int | None = None,
    mean_active_experts: float | None = None,
) -> Efficiency:
    """Efficiency figures from a training log: medians over a window of steps after warm-up.

    The first ``warmup`` rows are skipped (compilation, allocator growth, data-loader start); the median
    resists the odd slow step (checkpointing, evaluation) better than the mean.

    Args:
        rows: training-log rows with ``iter_time_s`` and ``tokens_per_s`` (as the training loop logs them,
            all devices together), optionally ``peak_memory_bytes`` and per-layer routing metrics.
        warmup: rows skipped at the start.
        flops: model dimensions for the FLOPs count (``flops.top_k`` is the nominal k).
        global_batch_size: sequences per iteration.
        seq_length: tokens per sequence.
        num_devices: devices sharing an iteration (TFLOP/s are per device).
        window: rows measured after the warm-up (None: all the rest).
        peak_memory_bytes: peak memory per device; default: the largest ``peak_memory_bytes`` in the rows.
        mean_active_experts: measured experts per token; default: the mean over layers and window rows of
            the rows' ``active_experts``. Pass 1 for a dense model. None and no routing metrics in the log:
            the measured figures are None.

    Returns:
        An :class:`Efficiency`.

    Raises:
        ReproError: no rows left after warm-up, or a window row without a finite ``iter_time_s`` /
            ``tokens_per_s``.
    """
    selected = _window(rows, warmup, window)
    iter_time_s = statistics.median(_column(selected, "iter_time_s"))
    tokens_per_s = statistics.median(_column(selected, "tokens_per_s"))
    if iter_time_s <= 0:
        raise ReproError(f"median iter_time_s over the window is {iter_time_s}: must be > 0")
    if peak_memory_bytes is None:
        peaks = [int(r["peak_memory_bytes"]) for r in rows if isinstance(r.get("peak_memory_bytes"), (int, float))]
        peak_memory_bytes = max(peaks) if peaks else None
    if mean_active_experts is None:
        per_layer = [r.active_experts for r in routing_from_log(rows, warmup=warmup, window=window)]
        per_layer = [k for k in per_layer if k is not None]
        mean_active_experts = statistics.fmean(per_layer) if per_layer else None
    analytic = analytic_flops_per_iteration(flops, global_batch_size, seq_length)
    measured = None
    if mean_active_experts is not None:
        measured = measured_flops_per_iteration(flops, global_batch_size, seq_length, mean_active_experts)
    return Efficiency(
        warmup_steps=warmup,
        window_steps=len(selected),
        iter_time_ms=iter_time_s * 1e3,
        tokens_per_s=tokens_per_s,
        peak_memory_bytes=peak_memory_bytes,
        num_devices=num_devices,
        global_batch_size=global_batch_size,
        seq_length=seq_length,
        nominal_experts=float(flops.top_k),
        mean_active_experts=mean_active_experts,
        flops_per_iter_analytic=analytic,
        flops_per_iter_measured=measured,
        tflops_per_device_analytic=tflops_per_device(analytic, iter_time_s, num_devices),
        tflops_per_device_measured=None if measured is None else tflops_per_device(measured, iter_time_s, num_devices),
        expert_flops_per_token_measured=(
            None if mean_active_experts is None else expert_flops_per_token(flops, mean_active_experts)
        ),
    )


# ------------------------------------------------------------------------------------------ records
def make_record(
    *,
    run_id: str,
    router: str,
    model: str,
    config: Mapping[str, Any],
    log_rows: Sequence[Mapping[str, Any]] = (),
    efficiency: Efficiency | None = None,
    routing: Sequence[LayerRouting] | None = None,
    lm_eval_results: Mapping[str, Any] | None = None,
    validation_loss: float | None = None,
    environment: Environment | None = None,
    experiment_name: str | None = None,
) -> RunRecord:
    """Assemble a run record (validated exactly as :func:`load_record` would validate its file).

    Args:
        run_id: unique name of the run.
        router: router name, or ``"dense"``.
        model: model config name (``"llama-185m"``, ``"tiny"``).
        config: the experiment config (JSON-able).
        log_rows: training-log rows: the loss curve, and the routing metrics when ``routing`` is None.
        efficiency: from :func:`efficiency_from_log`.
        routing: per-layer routing metrics; default: :func:`routing_from_log` over the same window as
            ``efficiency`` (all rows if there is none).
        lm_eval_results: lm-eval's results dict (``simple_evaluate``'s return value or its JSON file);
            per-sample logs (``samples``) are left out.
        validation_loss: held-out LM loss.
        environment: default :func:`environment_info`.
        experiment_name: default ``run_id``.

    Returns:
        The :class:`RunRecord`.

    Raises:
        ReproError: a value of the wrong type (e.g. a config that is not a JSON object).
    """
    if routing is None:
        routing = ()
        if any(_layer_metrics(r) for r in log_rows):
            warmup = efficiency.warmup_steps if efficiency else 0
            window = efficiency.window_steps if efficiency else None
            routing = routing_from_log(log_rows, warmup=warmup, window=window)
    lm_eval = None
    if lm_eval_results is not None:
        # lm-eval's dict holds numpy scalars; the record stores what lm-eval writes to its JSON file.
        lm_eval = _plain({k: v for k, v in lm_eval_results.items() if k != "samples"})
    data = {
        "run_id": run_id,
        "experiment": {"name": experiment_name or run_id, "router": router, "model": model, "config": _plain(config)},
        "environment": to_json(environment or environment_info()),
        "loss_curve": to_json(loss_curve_from_log(log_rows)),
        "routing": to_json(tuple(routing)),
        "efficiency": to_json(efficiency),
        "validation_loss": validation_loss,
        "lm_eval": lm_eval,
    }
    # Built through the same path a reader takes, so a record that is made is a record that loads.
    return from_json(RunRecord, data, f"record '{run_id}'")


def record_from_run_dir(
    run_dir: str | Path,
    *,
    warmup: int,
    window: int | None = None,
    lm_eval_results: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    environment: Environment | None = None,
) -> RunRecord:
    """Build the record of a finished training run from its output directory.

    Reads ``config.json`` (``experiment.{name, router, flavour, global_batch_size}``, ``seq_length``,
    ``vocab_size``, ``layout.{world_size, tp}``) and ``log.jsonl`` as the training loop writes them; the model
    dimensions for the FLOPs count come from ``repro.model.flavours.get_flavour(flavour)``. The validation
    loss is the last ``val_loss`` in the log.

    Args:
        run_dir: the run's output directory.
        warmup: log rows skipped before the efficiency window.
        window: log rows in the window (None: all after warm-up).
        lm_eval_results: lm-eval's results dict for the run's checkpoint, if evaluated.
        run_id: default: the experiment's name.
        environment: default :func:`environment_info` with the run's world size.

    Returns:
        The :class:`RunRecord` (write it with :func:`write_record`).

    Raises:
        ReproError: missing files or config fields.
    """
    from repro.model.flavours import get_flavour
    from repro.report.flops import flops_config_from_flavour

    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
        experiment = config["experiment"]
        router = experiment["router"] or "dense"
        overrides = {k: experiment[k] for k in ("num_experts", "top_k") if experiment.get(k) is not None}
        flavour = get_flavour(experiment["flavour"], **overrides)
        world_size = int(config["layout"]["world_size"])
        flops = flops_config_from_flavour(flavour, vocab_size=config["vocab_size"], tp=int(config["layout"]["tp"]))
        batch, seq_length = int(experiment["global_batch_size"]), int(config["seq_length"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ReproError(f"{run_dir / 'config.json'}: not a training run's config ({type(exc).__name__}: {exc})") from None
    rows = read_log_jsonl(run_dir / "log.jsonl")
    efficiency = efficiency_from_log(
        rows,
        warmup=warmup,
        window=window,
        flops=flops,
        global_batch_size=batch,
        seq_length=seq_length,
        num_devices=world_size,
        mean_active_experts=1.0 if router == "dense" or _merges_experts(router) else None,
    )
    val_losses = [r["val_loss"] for r in rows if isinstance(r.get("val_loss"), (int, float))]
    return make_record(
        run_id=run_id or experiment.get("name") or run_dir.name,
        router=router,
        model=flavour.name,
        config=config,
        log_rows=rows,
        efficiency=efficiency,
        lm_eval_results=lm_eval_results,
        validation_loss=float(val_losses[-1]) if val_losses else None,
        environment=environment or environment_info(num_processes=world_size),
        experiment_name=experiment.get("name"),
    )


def _merges_experts(router: str) -> bool:
    """Whether the router merges expert parameters (Lory): one merged FFN per token, whatever its map says.

    Read from the router's declared constraint (kind MERGE); False for names that are not registered here.
    """
    import routers

    try:
        instance = routers.build_router(router, hidden_size=8, num_experts=2)
    except ValueError:
        return False
    return instance.constraint.kind is routers.RoutingKind.MERGE


def _plain(obj: Any) -> Any:
    """``obj`` as plain JSON values (numpy/torch scalars to numbers, paths and other objects to strings)."""
    if not isinstance(obj, Mapping):
        return obj  # left for the schema check to refuse
    return json.loads(json.dumps(obj, default=_json_default))


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def write_record(record: RunRecord, path: str | Path) -> Path:
    """Write a record atomically.

    Args:
        record: the record.
        path: destination, conventionally ``<run dir>/record.json``.

    Returns:
        The path written.
    """
    write_json_atomic(path, to_json(record))
    return Path(path)


def load_record(path: str | Path) -> RunRecord:
    """Load and validate one record file.

    Args:
        path: a record JSON file.

    Returns:
        The :class:`RunRecord`.

    Raises:
        ReproError: unreadable JSON, missing or unknown field, wrong type (one line naming file and field).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ReproError(f"{path}: cannot read record: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ReproError(f"{path}: not a JSON file: {exc.msg} (line {exc.lineno})") from None
    return from_json(RunRecord, data, str(path))


def is_record_file(path: Path) -> bool:
    """Whether ``path`` is named like a run record (``record.json`` or ``*.record.json``)."""
    return path.name == "record.json" or path.name.endswith(".record.json")


def find_records(paths: Iterable[str | Path]) -> list[Path]:
    """Record files named by ``paths``: files as given, directories searched recursively.

    Args:
        paths: record files and/or directories.

    Returns:
        Record paths, in argument order, each directory's sorted.

    Raises:
        ReproError: a path that does not exist, or a directory without records.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            inside = sorted(p for p in path.rglob("*.json") if is_record_file(p))
            if not inside:
                raise ReproError(f"{path}: no run records (record.json or *.record.json) in this directory")
            found.extend(inside)
        else:
            raise ReproError(f"{path}: no such file or directory")
    return found


def load_records(paths: Iterable[str | Path]) -> list[RunRecord]:
    """Load every record named by ``paths`` (see :func:`find_records`).

    Args:
        paths: record files and/or directories.

    Returns:
        The records.

    Raises:
        ReproError: as :func:`find_records` and :func:`load_record`, or two records with the same run_id.
    """
    records: list[RunRecord] = []
    origin: dict[str, Path] = {}
    for path in find_records(paths):
        record = load_record(path)
        if record.run_id in origin:
            raise ReproError(f"{path}: run_id '{record.run_id}' is already used by {origin[record.run_id]}")
        origin[record.run_id] = path
        records.append(record)
    return records


def lm_eval_metrics(record: RunRecord) -> dict[str, dict[str, float]]:
    """lm-eval's per-task numbers, keyed by task then metric without the filter suffix.

    lm-eval writes ``"acc,none": 0.25``; this returns ``{"hellaswag": {"acc": 0.25, ...}}`` (only numbers,
    only the ``none`` filter, standard errors left out).

    Args:
        record: a run record.

    Returns:
        Per-task metrics (empty when the run was not evaluated).
    """
    if record.lm_eval is None:
        return {}
    out: dict[str, dict[str, float]] = {}
    for task, metrics in record.lm_eval["results"].items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if filt != "none" or name.endswith("_stderr") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                out.setdefault(task, {})[name] = float(value)
    return out
