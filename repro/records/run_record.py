"""The run record (``record.json``): everything the tables and checks read about one run, a frozen dataclass
tree. Each dataclass checks its ranges in ``__post_init__`` (listed in docs/evaluation.md), so a record built in
code is checked as one read from a file (:mod:`repro.records.store`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from repro.flavours import RENAMED

SCHEMA = "dirmoe-bench/run-record"
SCHEMA_VERSION = 1
#: The per-layer routing metrics a record keeps (names of the routers' metrics).
ROUTING_METRICS = ("active_experts", "simpson", "load_imbalance", "dropped_mass", "group_size", "fallback_share")
#: lm-eval metrics that are fractions besides the ``acc*`` family.
UNIT_METRICS = ("exact_match", "f1")
#: lm-eval metrics that are perplexities (exp of a mean negative log-likelihood: at least 1).
PERPLEXITY_METRICS = ("perplexity", "word_perplexity", "byte_perplexity")


#: Slack on the ends of [0, 1] for float32 routing shares (1 - sum(r) may round to -1e-7).
FLOAT32_SLACK = 1e-6


def _check(name: str, value: float | int | None, low: float | None = None, high: float | None = None,
           *, low_open: bool = False, slack: float = 0.0) -> None:
    """ValueError unless ``value`` is finite and in ``[low, high]`` (``(low, high]`` with ``low_open``) +- ``slack``;
    None passes. ``high`` needs ``low``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    too_low = low is not None and (value <= low - slack if low_open else value < low - slack)
    too_high = high is not None and value > high + slack
    if too_low or too_high:
        allowed = (f"in {'(' if low_open else '['}{low:g}, {high:g}]" if high is not None
                   else f"{'>' if low_open else '>='} {low:g}")
        raise ValueError(f"{name} = {value!r} is out of range (must be {allowed})")


def _check_fields(obj: Any, low: float | None, *names: str, high: float | None = None, low_open: bool = False,
                  slack: float = 0.0) -> None:
    for name in names:
        _check(name, getattr(obj, name), low, high, low_open=low_open, slack=slack)


@dataclass(frozen=True)
class ExperimentInfo:
    """What was run.

    Args:
        router: registered router name, or ``"dense"``.
        model: model flavour (``"tiny"``); published numbers are matched on it.
        config: the full experiment config (``config.json``).
    """

    name: str
    router: str
    model: str
    config: dict[str, Any]

    def __post_init__(self) -> None:  # a record written under a flavour's earlier name matches the published entries
        object.__setattr__(self, "model", RENAMED.get(self.model, self.model))


@dataclass(frozen=True)
class Environment:
    """Where it was run (:func:`repro.records.store.environment_info`): git commit (None outside a checkout) and
    dirtiness, package versions (None: not installed), accelerator, host, world size, OS and architecture."""

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

    def __post_init__(self) -> None:
        _check("num_processes", self.num_processes, 1)


@dataclass(frozen=True)
class LossPoint:
    """One point of the training loss curve."""

    step: int
    loss: float

    def __post_init__(self) -> None:
        _check("step", self.step, 0)
        _check("loss", self.loss)  # includes aux losses: no bound beyond finite


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's routing metrics averaged over the window (None: not reported): mean experts per token,
    Simpson index sum_i p_i^2 of combine weights, max/mean tokens per expert, routing mass dropped by dispatch.

    Args:
        group_size: tokens per routing group where the choice couples tokens (Expert Choice), else None.
        fallback_share: share of tokens dispatched only by a fallback rule (DirMoE's arg-max), else None.
    """

    layer: int
    active_experts: float | None
    simpson: float | None
    load_imbalance: float | None
    dropped_mass: float | None
    group_size: float | None = None
    fallback_share: float | None = None

    def __post_init__(self) -> None:
        # load_imbalance is >= 1 when any token is routed, 0 when none is.
        _check_fields(self, 0, "layer", "active_experts", "load_imbalance")
        _check_fields(self, 0, "simpson", "dropped_mass", "fallback_share", high=1, slack=FLOAT32_SLACK)
        _check_fields(self, 0, "group_size", low_open=True)


@dataclass(frozen=True)
class Efficiency:
    """Efficiency after warm-up (:func:`repro.records.log_figures.efficiency`): median iteration time, tokens/s
    (all devices), Megatron-LM FLOPs and TFLOP/s per device at nominal (analytic) and measured k. None: unknown.

    Args:
        peak_memory_bytes: peak per device (allocated CUDA memory on GPU, peak RSS on CPU).
        expert_flops_per_token_measured: expert (FFN) FLOPs per token at the measured k: compute parity.
        backend, flops_attention: ``te``/``torch``/``local``; :data:`repro.records.flops.ATTENTION_COUNTS` (None: full).
        start_step: step the timed run started from (0: initialisation, else the checkpoint's step).
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
    flops_attention: str | None = None
    start_step: int | None = None

    def __post_init__(self) -> None:
        if self.flops_attention not in (None, "causal", "full"):
            raise ValueError(f"flops_attention must be causal, full or null, got {self.flops_attention!r}")
        _check_fields(self, 0, "warmup_steps", "peak_memory_bytes", "nominal_experts", "mean_active_experts",
                      "expert_flops_per_token_measured", "start_step")
        _check_fields(self, 1, "window_steps", "num_devices", "global_batch_size", "seq_length")
        _check_fields(self, 0, "iter_time_ms", "tokens_per_s", "flops_per_iter_analytic", "flops_per_iter_measured",
                      "tflops_per_device_analytic", "tflops_per_device_measured", low_open=True)


@dataclass(frozen=True)
class DomainLoss:
    """Mean next-token cross-entropy (nats/token) on one domain's held-out documents (``meta.pile_set_name``)."""

    domain: str
    loss: float
    tokens: int

    def __post_init__(self) -> None:
        if not self.domain:
            raise ValueError("domain must not be empty")
        _check("loss", self.loss, 0)
        _check("tokens", self.tokens, 1)


@dataclass(frozen=True)
class PartialTask:
    """A task scored on part of its documents (lm-eval's ``limit``: ``python -m repro eval --limit N``).

    Args:
        task: lm-eval task name.
        limit: lm-eval's limit (documents, or a fraction below 1); None: not recorded.
        evaluated, available: documents scored / in the task (``n-samples.effective`` / ``original``; None: unknown).
    """

    task: str
    limit: float | None
    evaluated: int | None
    available: int | None

    def __post_init__(self) -> None:
        _check("limit", self.limit, 0, low_open=True)
        _check("evaluated", self.evaluated, 0)
        _check("available", self.available, 1)
        if self.evaluated is not None and self.available is not None and self.evaluated >= self.available:
            raise ValueError(f"task '{self.task}': evaluated = {self.evaluated} documents of {self.available} "
                             "is not partial")

    def describe(self) -> str:
        """``task: 8 of 175 documents`` (or ``task: limit 8``)."""
        if self.evaluated is not None and self.available is not None:
            return f"{self.task}: {self.evaluated} of {self.available} documents"
        return f"{self.task}: limit {self.limit:g}" if self.limit is not None else f"{self.task}: part of its documents"


@dataclass(frozen=True)
class RunRecord:
    """One run's ``record.json``: what ran where, loss curve, per-layer routing, efficiency, final held-out loss.

    Args:
        lm_eval: lm-eval's results dict without ``samples``; None if not evaluated.
        per_question: :func:`repro.stats.compact_per_question` of lm-eval's samples (None: not logged).
        partial: tasks scored on fewer documents than they have; tables mark their cells.
        domain_losses: final held-out LM loss per domain (empty: not measured).
        schema, schema_version: ``dirmoe-bench/run-record`` and the layout version.
    """

    run_id: str
    experiment: ExperimentInfo
    environment: Environment
    loss_curve: tuple[LossPoint, ...]
    routing: tuple[LayerRouting, ...]
    efficiency: Efficiency | None
    validation_loss: float | None
    lm_eval: dict[str, Any] | None
    per_question: dict[str, Any] | None = None
    partial: tuple[PartialTask, ...] = ()
    domain_losses: tuple[DomainLoss, ...] = ()
    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for name, want in (("schema", SCHEMA), ("schema_version", SCHEMA_VERSION)):
            if getattr(self, name) != want:
                raise ValueError(f"field '{name}' must be {want!r}, got {getattr(self, name)!r}")
        _check("field 'validation_loss'", self.validation_loss, 0)
        tasks: set[str] = set()
        if self.lm_eval is not None:
            results = self.lm_eval.get("results")
            if not isinstance(results, dict) or not all(isinstance(v, dict) for v in results.values()):
                raise ValueError("field 'lm_eval.results' must be an object of per-task objects (lm-eval's layout)")
            tasks = set(results)
            for task, metrics in results.items():
                for key, value in metrics.items():
                    _check_lm_eval_value(f"field 'lm_eval.results.{task}.{key}'", key, value)
            _check_n_samples(self.lm_eval.get("n-samples"))
        if self.per_question is not None:
            if self.lm_eval is None:
                raise ValueError("field 'per_question' needs the lm-eval results it belongs to (field 'lm_eval')")
            _check_per_question(self.per_question, self.lm_eval.get("n-samples"))
        for entry in self.partial:
            if entry.task not in tasks:
                raise ValueError(f"field 'partial': task '{entry.task}' has no lm-eval result in this record")
        domains = [d.domain for d in self.domain_losses]
        if len(set(domains)) != len(domains):
            raise ValueError("field 'domain_losses' names a domain twice")


def _check_lm_eval_value(where: str, key: str, value: Any) -> None:
    """Check one lm-eval number's range by metric name (``acc``: a fraction; ``*_stderr``: >= 0; ...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # aliases, "N/A" standard errors, sample counts kept as text
    name = key.partition(",")[0]
    if name.endswith("_stderr") or name == "bits_per_byte":
        _check(where, value, 0)
    elif name.startswith("acc") or name in UNIT_METRICS:
        _check(where, value, 0, 1)
    elif name in PERPLEXITY_METRICS:
        _check(where, value, 1)
    else:
        _check(where, value)


def _check_n_samples(n_samples: Any) -> None:
    """lm-eval's ``n-samples``: ``{task: {"original": N, "effective": M}}`` with 0 <= M <= N."""
    if n_samples is None:
        return
    if not isinstance(n_samples, Mapping):
        raise ValueError("field 'lm_eval.n-samples' must be an object (lm-eval's layout)")
    for task, counts in n_samples.items():
        where = f"field 'lm_eval.n-samples.{task}'"
        if not isinstance(counts, Mapping) or not {"original", "effective"} <= set(counts):
            raise ValueError(f"{where} must hold 'original' and 'effective' document counts")
        for name in ("original", "effective"):
            value = counts[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where}.{name} must be an integer, got {type(value).__name__}")
            _check(f"{where}.{name}", value, 0)
        if counts["effective"] > counts["original"]:
            raise ValueError(f"{where}: effective = {counts['effective']} exceeds original = {counts['original']}")


def _check_per_question(per_question: Mapping[str, Any], n_samples: Any) -> None:
    """``{task: {"docs_sha256": str, metric: [score per question]}}``, accuracies 0/1, one length per task."""
    for task, entry in per_question.items():
        where = f"field 'per_question.{task}'"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("docs_sha256"), str):
            raise ValueError(f"{where} must be an object with 'docs_sha256' and per-question score lists")
        lengths = set()
        for metric, scores in entry.items():
            if metric == "docs_sha256":
                continue
            if not isinstance(scores, list):
                raise ValueError(f"{where}.{metric} must be a list of per-question scores")
            unit = metric.startswith("acc") or metric in UNIT_METRICS
            for i, score in enumerate(scores):
                _check(f"{where}.{metric}[{i}]", score, 0 if unit else None, 1 if unit else None)
            lengths.add(len(scores))
        if len(lengths) > 1:
            raise ValueError(f"{where}: its metrics list different numbers of questions ({sorted(lengths)})")
        counts = n_samples.get(task) if isinstance(n_samples, Mapping) else None
        if lengths and isinstance(counts, Mapping) and counts.get("effective") not in lengths:
            raise ValueError(f"{where}: {lengths.pop()} questions, but lm-eval scored {counts.get('effective')} "
                             "(n-samples)")


def partial_tasks(lm_eval_results: Mapping[str, Any] | None) -> tuple[PartialTask, ...]:
    """One :class:`PartialTask` per task of lm-eval's results (None: not evaluated) scored on part of its documents
    (``n-samples`` effective < original; with a ``config.limit`` but no ``n-samples``: every task, counts
    unknown), sorted by task."""
    if not lm_eval_results:
        return ()
    config = lm_eval_results.get("config")
    limit = config.get("limit") if isinstance(config, Mapping) else None
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        limit = None
    n_samples = lm_eval_results.get("n-samples")
    tasks = sorted(lm_eval_results.get("results") or {})
    if not isinstance(n_samples, Mapping):
        return tuple(PartialTask(task, limit, None, None) for task in tasks) if limit is not None else ()
    out = []
    for task in tasks:
        counts = n_samples.get(task)
        if not isinstance(counts, Mapping):
            continue
        effective, original = counts.get("effective"), counts.get("original")
        if isinstance(effective, int) and isinstance(original, int) and effective < original:
            out.append(PartialTask(task, limit, effective, original))
    return tuple(out)


def lm_eval_metrics(record: RunRecord) -> dict[str, dict[str, float]]:
    """lm-eval's numbers as ``{task: {"acc": 0.25, ...}}``: ``none`` filter only, no standard errors (empty if not
    evaluated)."""
    if record.lm_eval is None:
        return {}
    out: dict[str, dict[str, float]] = {}
    for task, metrics in record.lm_eval["results"].items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and filt == "none" and not name.endswith("_stderr"):
                out.setdefault(task, {})[name] = float(value)
    return out
