"""The run record: one JSON file per run holding everything the tables and checks read.

A record (:class:`RunRecord`, written as ``record.json`` in the run directory) holds what was run (the
experiment's name, router, model and full config), where it ran, the loss curve, per-layer routing metrics,
the efficiency figures and lm-eval's results dict exactly as lm-eval returns it. It is a frozen dataclass
tree; :mod:`repro.report.store` builds, writes and loads records, refusing a file with a missing field, an
unknown field, a wrong type or a value out of range with one line naming the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA = "dirmoe-bench/run-record"
SCHEMA_VERSION = 1
#: The per-layer routing metrics a record keeps (names of the routers' metrics).
ROUTING_METRICS = ("active_experts", "simpson", "load_imbalance", "dropped_mass", "group_size", "fallback_share")


@dataclass(frozen=True)
class ExperimentInfo:
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
        group_size: tokens per routing group, for routers whose choice couples a group of tokens (Expert
            Choice); None for the others.
        fallback_share: share of tokens dispatched only by a fallback rule (DirMoE's arg-max of r when no gate
            passes its threshold); None for routers without one.
    """

    layer: int
    active_experts: float | None
    simpson: float | None
    load_imbalance: float | None
    dropped_mass: float | None
    group_size: float | None = None
    fallback_share: float | None = None


@dataclass(frozen=True)
class Efficiency:
    """Training efficiency over a window of steps after warm-up (see :func:`repro.report.efficiency.efficiency`).

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
        backend: the modules the model was built with (``te``, ``torch``, ``local``; None where not recorded).
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
    backend: str | None = None


@dataclass(frozen=True)
class RunRecord:
    """One run, as written to ``record.json``.

    Args:
        run_id: unique name of the run.
        experiment: see :class:`ExperimentInfo`.
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
    experiment: ExperimentInfo
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
