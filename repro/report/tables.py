"""The paper's tables, generated from run records (never edited by hand): zero-shot accuracy, validation loss,
efficiency (with a compute-parity verdict) and routing, per run; validation and routing over seeds, marked as
:func:`~repro.report.seed_tables.seed_zero_shot_table` is. A zero-shot cell of a task scored on part of its
documents carries a dagger. With a ledger (:mod:`repro.report.ledger`), each run is followed by the published
rows of its router in the same model setting and a ``delta`` row. What the tables share is in
:mod:`repro.report.table_core`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from repro.evaluation.local_tasks import LOCAL_TASK_LABELS
from repro.report.flops import formula_name
from repro.report.ledger import PublishedEntry
from repro.report.parity import DEFAULT_PARITY_TOLERANCE, DEFAULT_REFERENCE_ROUTER, compute_parity
from repro.report.record import RunRecord, lm_eval_metrics
from repro.report.seed_tables import compare_metrics_over_seeds, seed_metric_table
from repro.report.table_core import (
    MISSING,
    PAPER_TASKS,
    PARTIAL,
    PLUS_MINUS,
    Table,
    _fmt,
    _fmt_pm,
    _fmt_tflops,
    _labels,
    _ordered,
    _partial_note,
    _published_groups,
    choose_metric,
    lm_eval_stderr,
    record_partial,
)


# ------------------------------------------------------------------------------------------ zero-shot
def zero_shot_table(
    records: Sequence[RunRecord], *, metric: str = "auto", ledger: Sequence[PublishedEntry] | None = None
) -> Table:
    """The zero-shot accuracy table (percent).

    Args:
        records: runs with lm-eval results (runs without are left out).
        metric: ``auto``, ``acc`` or ``acc_norm`` (see :func:`choose_metric`); both are in every record.
        ledger: published numbers to show beside the runs (None: measured rows only).

    Returns:
        The :class:`Table`.
    """
    evaluated = [r for r in _ordered(records) if r.lm_eval is not None]
    scores = {r.run_id: lm_eval_metrics(r) for r in evaluated}
    published = {r.run_id: _published_groups(r, ledger or (), "zero_shot.") for r in evaluated}
    has_published = {
        m.removeprefix("zero_shot.") for groups in published.values() for g in groups.values() for m in g
    }
    measured_tasks = {t for s in scores.values() for t, m in s.items() if "acc" in m or "acc_norm" in m}
    tasks = [t for t in PAPER_TASKS if t in measured_tasks or t in has_published]
    tasks += sorted(measured_tasks - set(PAPER_TASKS))
    chosen = {t: choose_metric(t, evaluated, metric) for t in tasks}
    paper_columns_only = tasks == list(PAPER_TASKS)

    def avg(values: list[float | None]) -> float | None:
        return statistics.fmean(values) if values and all(v is not None for v in values) else None

    def percent(run_id: str, task: str) -> float | None:
        value = scores[run_id].get(task, {}).get(chosen[task])
        return None if value is None else 100 * value

    def percent_stderr(record: RunRecord, task: str) -> float | None:
        value = lm_eval_stderr(record, task, chosen[task])
        return None if value is None else 100 * value

    def published_value(entries: dict[str, PublishedEntry], metric_name: str) -> float | None:
        entry = entries.get(metric_name)
        return None if entry is None else entry.value

    rows: list[tuple[str, ...]] = []
    labels = _labels(evaluated)
    partial = {labels[r.run_id]: {t: p for t, p in record_partial(r).items() if t in tasks} for r in evaluated}
    for record in evaluated:
        values = [percent(record.run_id, t) for t in tasks]
        errors = [percent_stderr(record, t) for t in tasks]
        mean = avg(values)
        # The tasks' question sets are independent: the standard error of the mean of k scores adds in quadrature.
        mean_error = math.sqrt(sum(e**2 for e in errors)) / len(errors) if errors and None not in errors else None
        cut = partial[labels[record.run_id]]
        cells = [_fmt_pm(v, e, PARTIAL if t in cut else "") for t, v, e in zip(tasks, values, errors)]
        rows.append((labels[record.run_id], *cells, _fmt_pm(mean, mean_error, PARTIAL if cut else "")))
        for source, entries in published[record.run_id].items():
            pub = [published_value(entries, f"zero_shot.{t}") for t in tasks]
            # The published average is over the seven paper tasks: shown only when those are the columns.
            pub_avg = published_value(entries, "zero_shot.avg") if paper_columns_only else None
            rows.append((f"{record.experiment.router} [{source}]", *(_fmt(v, ".2f") for v in pub), _fmt(pub_avg, ".2f")))
            deltas = [None if m is None or p is None else m - p for m, p in zip(values, pub)]
            avg_delta = None if mean is None or pub_avg is None else mean - pub_avg
            rows.append((f"delta vs {source}", *(_fmt(d, "+.2f") for d in deltas), _fmt(avg_delta, "+.2f")))

    headers = ("Router", *(PAPER_TASKS.get(t) or LOCAL_TASK_LABELS.get(t, t) for t in tasks), "Avg.")
    metric_text = ", ".join(f"{PAPER_TASKS.get(t) or LOCAL_TASK_LABELS.get(t, t)} {chosen[t]}" for t in tasks)
    rule = " (acc_norm where every run reports it, acc otherwise)" if metric == "auto" else ""
    caption = (
        f"Zero-shot accuracy (%), lm-eval, 0-shot. Metric per column: {metric_text or 'none'}{rule}. "
        "Avg. is the mean over the task columns shown. "
        f"{PLUS_MINUS} is lm-eval's standard error over the task's questions, s/sqrt(n) of the per-question 0/1 "
        "scores (not a spread over seeds); for Avg. the task errors combined in quadrature, "
        "sqrt(sum se^2)/k; none where lm-eval computed none (bootstrap_iters=0)."
    ) + _partial_note(partial)
    if ledger is not None:
        caption += (
            " Rows 'router [paper table]' are published numbers for the same model (the papers do not say "
            "whether they report acc or acc_norm); 'delta' rows are measured minus published."
        )
    return Table("zero_shot", caption, headers, tuple(rows))


# ------------------------------------------------------------------------------------------ validation loss
VALID_SPLIT = "valid_split"
HELDOUT = "heldout"


def heldout_loss(record: RunRecord) -> float | None:
    """The held-out LM loss over all the tokens of the record's per-domain losses (token-weighted).

    Args:
        record: a run record.

    Returns:
        nats/token, None where the run has no per-domain losses.
    """
    tokens = sum(d.tokens for d in record.domain_losses)
    return sum(d.loss * d.tokens for d in record.domain_losses) / tokens if tokens else None


def _validation_columns(records: Sequence[RunRecord]) -> dict[str, Callable[[RunRecord], float | None]]:
    """The validation-loss columns some run has: the trainer's, then held-out overall, then each domain."""
    columns: dict[str, Callable[[RunRecord], float | None]] = {}
    if any(r.validation_loss is not None for r in records):
        columns[VALID_SPLIT] = lambda r: r.validation_loss
    domains = list(dict.fromkeys(d.domain for r in records for d in r.domain_losses))
    if domains:
        columns[HELDOUT] = heldout_loss
    for domain in domains:
        columns[domain] = lambda r, domain=domain: next((d.loss for d in r.domain_losses if d.domain == domain), None)
    return columns


def _validation_text(records: Sequence[RunRecord]) -> tuple[str, dict[str, str]]:
    """The validation tables' first caption sentences and column labels."""
    tokens: dict[str, set[int]] = {}
    for record in records:
        for d in record.domain_losses:
            tokens.setdefault(d.domain, set()).add(d.tokens)
    counts = ", ".join(f"{d} {min(n)}" if len(n) == 1 else f"{d} {min(n)}-{max(n)}" for d, n in tokens.items())
    text = (
        "Validation LM loss at the end of training (nats/token; lower is better). 'valid split': the trainer's "
        "loss on the validation split of the training corpus (documents never trained on). 'held-out' and the "
        "domain columns: next-token loss on the held-out documents of each domain (never in the training data), "
        "over all their scored tokens and per domain"
        + (f" (tokens scored: {counts})." if counts else ".")
    )
    labels = {VALID_SPLIT: "valid split", HELDOUT: "held-out"}
    return text, labels


def validation_table(records: Sequence[RunRecord]) -> Table:
    """The validation loss of each run: the trainer's, the held-out loss and one column per domain.

    Args:
        records: runs (runs with neither number are left out).

    Returns:
        The :class:`Table` (name ``validation``).
    """
    columns = _validation_columns(records)
    measured = [r for r in _ordered(records) if any(f(r) is not None for f in columns.values())]
    labels = _labels(measured)
    text, names = _validation_text(measured)
    rows = tuple((labels[r.run_id], *(_fmt(f(r), ".3f") for f in columns.values())) for r in measured)
    return Table("validation", text, ("Router", *(names.get(c, c) for c in columns)), rows)


def validation_seed_table(records: Sequence[RunRecord], **options: Any) -> Table:
    """:func:`validation_table` over seeds: mean +- CI per router, ``*`` where it differs from the reference.

    Args:
        records: runs of one model, one per router and seed.
        **options: :func:`compare_metrics_over_seeds`'s keyword arguments.

    Returns:
        The :class:`Table` (name ``validation_seeds``).
    """
    columns = _validation_columns(records)
    comparison = compare_metrics_over_seeds(records, columns, **options)
    measured = [r for r in records if any(f(r) is not None for f in columns.values())]
    text, labels = _validation_text(measured)
    return seed_metric_table(comparison, name="validation_seeds", what=text, labels=labels)


#: The routing statistics shown over seeds: name -> (header, number format).
SEED_ROUTING_METRICS = {
    "active_experts": ("active experts", ".3f"),
    "simpson": ("Simpson index", ".3f"),
    "load_imbalance": ("load imbalance", ".2f"),
}


def _layer_mean(name: str) -> Callable[[RunRecord], float | None]:
    def mean(record: RunRecord) -> float | None:
        values = [getattr(layer, name) for layer in record.routing if getattr(layer, name) is not None]
        return statistics.fmean(values) if values else None

    return mean


def routing_seed_table(records: Sequence[RunRecord], **options: Any) -> Table:
    """The routing statistics (mean over layers) over seeds: mean +- CI per router, marked against the reference.

    Args:
        records: runs of one model, one per router and seed (dense runs, without routing, are left out).
        **options: :func:`compare_metrics_over_seeds`'s keyword arguments.

    Returns:
        The :class:`Table` (name ``routing_seeds``).
    """
    columns = {name: _layer_mean(name) for name in SEED_ROUTING_METRICS}
    comparison = compare_metrics_over_seeds([r for r in records if r.routing], columns, **options)
    return seed_metric_table(
        comparison,
        name="routing_seeds",
        what=(
            "Routing behaviour over seeds, the mean over layers of each run's averages over its measured steps: "
            "experts per token, Simpson index sum_i p_i^2 of the combine weights (1/E uniform, 1 one expert), "
            "load imbalance (max / mean tokens per expert)."
        ),
        labels={name: header for name, (header, _) in SEED_ROUTING_METRICS.items()},
        specs={name: spec for name, (_, spec) in SEED_ROUTING_METRICS.items()},
    )


# ------------------------------------------------------------------------------------------ efficiency
def efficiency_table(
    records: Sequence[RunRecord],
    *,
    ledger: Sequence[PublishedEntry] | None = None,
    parity_tolerance: float = DEFAULT_PARITY_TOLERANCE,
    reference_router: str = DEFAULT_REFERENCE_ROUTER,
) -> Table:
    """The training-efficiency table, with a compute-parity verdict per run.

    Args:
        records: runs with efficiency figures (runs without are left out).
        ledger: published numbers to show beside the runs (None: measured rows only).
        parity_tolerance: relative tolerance on measured expert FLOPs per token (see
            :func:`repro.report.parity.compute_parity`).
        reference_router: the router of the parity reference run.

    Returns:
        The :class:`Table`.
    """
    measured = [r for r in _ordered(records) if r.efficiency is not None]
    parity = compute_parity(measured, tolerance=parity_tolerance, reference_router=reference_router)
    labels = _labels(measured)
    rows: list[tuple[str, ...]] = []
    for record in measured:
        e = record.efficiency
        memory = None if e.peak_memory_bytes is None else e.peak_memory_bytes / 2**30
        groups = [layer.group_size for layer in record.routing if layer.group_size is not None]
        rows.append((
            labels[record.run_id], _fmt(e.iter_time_ms, ".1f"), _fmt_tflops(e.tflops_per_device_analytic),
            _fmt_tflops(e.tflops_per_device_measured), _fmt(e.tokens_per_s, ".0f"), _fmt(memory, ".2f"),
            _fmt(e.mean_active_experts, ".3f"), _fmt(statistics.fmean(groups) if groups else None, ".0f"),
            str(e.num_devices), record.environment.device, e.backend or MISSING, parity[record.run_id].note,
        ))
        for source, entries in _published_groups(record, ledger or (), "efficiency.").items():
            ms = entries.get("efficiency.iter_time_ms")
            tf = entries.get("efficiency.tflops_per_device")
            setting = next(iter(entries.values())).setting
            rows.append((
                f"{record.experiment.router} [{source}]", _fmt(ms.value if ms else None, ".1f"),
                _fmt_tflops(tf.value if tf else None), *[MISSING] * 5,
                MISSING if setting.num_devices is None else str(setting.num_devices), setting.hardware or MISSING,
                MISSING, f"published, {setting.model}",
            ))
    headers = (
        "Router", "ms/iter", "TFLOP/s/dev (analytic)", "TFLOP/s/dev (measured)", "tokens/s", "peak mem (GiB)",
        "active experts", "token group", "devices", "device", "backend", "compute parity",
    )
    caption = (
        "Training efficiency. ms/iter and tokens/s (all devices): medians over the steps after warm-up. "
        f"TFLOP/s per device by {_flops_formulas(measured)}, at the nominal k (analytic) and at the measured "
        "mean experts per token (measured); B sequences of s tokens, L layers, hidden h, a heads, g query groups, "
        "d head size, f FFN size per expert, V padded vocabulary. Token group: tokens that compete for the experts together, for "
        "routers whose choice couples tokens (Expert Choice; -- for the others). Backend: the modules "
        "megatron-core built (te: TransformerEngine; torch: torch's grouped GEMM and SDPA; local: megatron's "
        "local spec). Compute parity: measured "
        "expert FLOPs per token within "
        f"+-{parity_tolerance * 100:g}% of the reference run (router '{reference_router}' where present)."
    )
    starts = {r.run_id: r.efficiency.start_step for r in measured if r.efficiency.start_step}
    if starts:
        caption += " Timed from trained checkpoints (weights and router schedules at step): " + ", ".join(
            f"{labels[run_id]} {step}" for run_id, step in starts.items()
        ) + "; the other runs from initialisation."
    if ledger is not None:
        caption += " Rows 'router [paper table]' are published numbers for the same model."
    return Table("efficiency", caption, headers, tuple(rows))


def _flops_formulas(records: Sequence[RunRecord]) -> str:
    """The FLOPs count(s) the records' TFLOP/s come from, named (:func:`repro.report.flops.formula_name`)."""
    counts = sorted({r.efficiency.flops_attention or "" for r in records})
    if len(counts) == 1:
        return formula_name(counts[0] or None)
    return "; ".join(
        f"{formula_name(c or None)} ({', '.join(r.run_id for r in records if (r.efficiency.flops_attention or '') == c)})"
        for c in counts
    )


# ------------------------------------------------------------------------------------------ routing
def routing_table(records: Sequence[RunRecord]) -> Table:
    """Routing behaviour per run: the mean over layers, then each layer.

    Args:
        records: runs (dense runs, which have no routing metrics, are left out).

    Returns:
        The :class:`Table`.
    """
    routed = [r for r in _ordered(records) if r.routing]
    labels = _labels(routed)
    names = ("active_experts", "simpson", "load_imbalance", "dropped_mass", "fallback_share")
    specs = (".3f", ".3f", ".2f", ".4f", ".3f")
    rows: list[tuple[str, ...]] = []
    for record in routed:
        means = []
        for name in names:
            values = [getattr(layer, name) for layer in record.routing if getattr(layer, name) is not None]
            means.append(statistics.fmean(values) if values else None)
        rows.append((labels[record.run_id], "mean", *(_fmt(v, s) for v, s in zip(means, specs))))
        for layer in record.routing:
            rows.append(
                (labels[record.run_id], str(layer.layer), *(_fmt(getattr(layer, n), s) for n, s in zip(names, specs)))
            )
    headers = ("Router", "Layer", "active experts", "Simpson index", "load imbalance", "dropped mass", "fallback share")
    caption = (
        "Routing behaviour, averaged over the measured steps: experts per token, Simpson index sum_i p_i^2 of "
        "the combine weights (1/E uniform, 1 one expert), load imbalance (max / mean tokens per expert), "
        "the routing-weight mass the dispatch rule dropped, and the share of tokens dispatched only by a "
        "fallback rule (DirMoE: no gate above its threshold, the arg-max of r taken)."
    )
    return Table("routing", caption, headers, tuple(rows))
