"""The paper's tables, generated from run records: zero-shot accuracy, validation loss, efficiency (with a
compute-parity verdict) and routing, per run; validation and routing over seeds (:mod:`repro.report.seed_tables`).
With a ledger (:mod:`repro.report.published`), each run is followed by the published rows of its router in the
same model setting and a ``delta`` row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from repro.records.flops import formula_name
from repro.records.run_record import RunRecord
from repro.report.compute_parity import DEFAULT_PARITY_TOLERANCE, DEFAULT_REFERENCE_ROUTER, compute_parity
from repro.report.published import PublishedEntry, select
from repro.report.seed_tables import SeedComparison, compare_metrics_over_seeds, seed_metric_table
from repro.report.table_core import (
    MISSING,
    PAPER_TASKS,
    PARTIAL,
    PLUS_MINUS,
    Table,
    _fmt,
    _fmt_pm,
    _partial_note,
    mean_or_none,
    metric_text,
    record_partial,
    task_label,
    zero_shot_columns,
)


def _ordered(records: Sequence[RunRecord]) -> list[RunRecord]:
    """Dense first, then by router name and run_id: independent of file names and argument order."""
    return sorted(records, key=lambda r: (r.experiment.router != "dense", r.experiment.router, r.run_id))


def _labels(records: Sequence[RunRecord]) -> dict[str, str]:
    """Row label per run: the router, or ``router (run_id)`` where a router has several runs (a run id equal to
    the router's name stays plain; variants, ``router+...``, are their id)."""
    routers = [r.experiment.router for r in records]

    def label(r: RunRecord) -> str:
        router = r.experiment.router
        if routers.count(router) == 1 or r.run_id == router:
            return router
        return r.run_id if r.run_id.startswith(f"{router}+") else f"{router} ({r.run_id})"

    return {r.run_id: label(r) for r in records}


def _published_groups(
    record: RunRecord, ledger: Sequence[PublishedEntry], prefix: str
) -> dict[str, dict[str, PublishedEntry]]:
    """Original published entries for this run's router and model, ``source -> metric -> entry``."""
    groups: dict[str, dict[str, PublishedEntry]] = {}
    for e in select(ledger, router=record.experiment.router, model_id=record.experiment.model, originals_only=True):
        if e.metric.startswith(prefix):
            groups.setdefault(e.measured_in, {})[e.metric] = e
    return groups


def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _value(entry: PublishedEntry | None) -> float | None:
    return None if entry is None else entry.value


def _stderr(record: RunRecord, task: str, metric: str) -> float | None:
    """lm-eval's standard error of a task's metric, None where absent (``bootstrap_iters=0``)."""
    value = record.lm_eval["results"].get(task, {}).get(f"{metric}_stderr,none")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ------------------------------------------------------------------------------------------ zero-shot
def zero_shot_table(
    records: Sequence[RunRecord], *, metric: str = "auto", ledger: Sequence[PublishedEntry] | None = None
) -> Table:
    """The zero-shot accuracy table (percent); a cell of a task scored on part of its documents carries a dagger.

    Args:
        records: runs with lm-eval results (runs without are left out).
        metric: ``auto``, ``acc`` or ``acc_norm`` (:func:`choose_metric`).
        ledger: published numbers to show beside the runs (None: measured rows only).
    """
    evaluated = [r for r in _ordered(records) if r.lm_eval is not None]
    published = {r.run_id: _published_groups(r, ledger or (), "zero_shot.") for r in evaluated}
    has_published = {m.removeprefix("zero_shot.") for groups in published.values() for g in groups.values() for m in g}
    scores, chosen = zero_shot_columns(evaluated, metric, has_published)
    tasks = list(chosen)
    rows: list[tuple[str, ...]] = []
    labels = _labels(evaluated)
    partial = {labels[r.run_id]: {t: p for t, p in record_partial(r).items() if t in tasks} for r in evaluated}
    for record in evaluated:
        values = [_percent(scores[record.run_id].get(t, {}).get(chosen[t])) for t in tasks]
        errors = [_percent(_stderr(record, t, chosen[t])) for t in tasks]
        mean = mean_or_none(values)
        # Independent question sets: the mean's standard error adds in quadrature.
        mean_error = math.sqrt(sum(e**2 for e in errors)) / len(errors) if errors and None not in errors else None
        cut = partial[labels[record.run_id]]
        cells = [_fmt_pm(v, e, PARTIAL if t in cut else "") for t, v, e in zip(tasks, values, errors)]
        rows.append((labels[record.run_id], *cells, _fmt_pm(mean, mean_error, PARTIAL if cut else "")))
        for source, entries in published[record.run_id].items():
            pub = [_value(entries.get(f"zero_shot.{t}")) for t in tasks]
            # The published average covers the seven paper tasks: shown only when those are the columns.
            pub_avg = _value(entries.get("zero_shot.avg")) if tasks == list(PAPER_TASKS) else None
            rows.append((f"{record.experiment.router} [{source}]", *(_fmt(v, ".2f") for v in pub), _fmt(pub_avg, ".2f")))
            deltas = [None if m is None or p is None else m - p for m, p in zip(values, pub)]
            avg_delta = None if mean is None or pub_avg is None else mean - pub_avg
            rows.append((f"delta vs {source}", *(_fmt(d, "+.2f") for d in deltas), _fmt(avg_delta, "+.2f")))

    headers = ("Router", *map(task_label, tasks), "Avg.")
    rule = " (acc_norm where every run reports it, acc otherwise)" if metric == "auto" else ""
    caption = (
        f"Zero-shot accuracy (%), lm-eval, 0-shot. Metric per column: {metric_text(chosen)}{rule}. "
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
_VALIDATION_LABELS = {VALID_SPLIT: "valid split", HELDOUT: "held-out"}


def heldout_loss(record: RunRecord) -> float | None:
    """Token-weighted held-out LM loss (nats/token) over the per-domain losses, None where absent."""
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


def _validation_text(records: Sequence[RunRecord]) -> str:
    """The validation tables' first caption sentences."""
    tokens: dict[str, set[int]] = {}
    for record in records:
        for d in record.domain_losses:
            tokens.setdefault(d.domain, set()).add(d.tokens)
    counts = ", ".join(f"{d} {min(n)}" if len(n) == 1 else f"{d} {min(n)}-{max(n)}" for d, n in tokens.items())
    return (
        "Validation LM loss at the end of training (nats/token; lower is better). 'valid split': the trainer's "
        "loss on the validation split of the training corpus (documents never trained on). 'held-out' and the "
        "domain columns: next-token loss on the held-out documents of each domain (never in the training data), "
        "over all their scored tokens and per domain"
        + (f" (tokens scored: {counts})." if counts else ".")
    )


def validation_table(records: Sequence[RunRecord]) -> Table:
    """Each run's validation loss: the trainer's, held-out, and per domain (runs with neither left out)."""
    columns = _validation_columns(records)
    measured = [r for r in _ordered(records) if any(f(r) is not None for f in columns.values())]
    labels = _labels(measured)
    rows = tuple((labels[r.run_id], *(_fmt(f(r), ".3f") for f in columns.values())) for r in measured)
    headers = ("Router", *(_VALIDATION_LABELS.get(c, c) for c in columns))
    return Table("validation", _validation_text(measured), headers, rows)


def validation_seed_table(records: Sequence[RunRecord], **options: Any) -> Table:
    """:func:`validation_table` over seeds (``validation_seeds``) of one model's runs, one per router and seed,
    marked against the reference (``options``: :func:`compare_metrics_over_seeds`'s keyword arguments)."""
    columns = _validation_columns(records)
    comparison = compare_metrics_over_seeds(records, columns, **options)
    return seed_metric_table(
        comparison, name="validation_seeds", what=_validation_text(records), labels=_VALIDATION_LABELS
    )


#: The routing statistics of the ``routing`` table: name -> (header, number format); the first three over seeds.
ROUTING_COLUMNS = {
    "active_experts": ("active experts", ".3f"), "simpson": ("Simpson index", ".3f"),
    "load_imbalance": ("load imbalance", ".2f"), "dropped_mass": ("dropped mass", ".4f"),
    "fallback_share": ("fallback share", ".3f"),
}
ROUTING_HEADERS = {name: header for name, (header, _) in ROUTING_COLUMNS.items()}
_ROUTING_TEXT = (
    "experts per token, Simpson index sum_i p_i^2 of the combine weights (1/E uniform, 1 one expert), load imbalance "
    "(max / mean tokens per expert)"
)


def layer_mean(name: str) -> Callable[[RunRecord], float | None]:
    """A run's routing statistic ``name`` averaged over its MoE layers (None where no layer has it)."""
    return lambda record: mean_or_none([v for layer in record.routing if (v := getattr(layer, name)) is not None])


def routing_seed_comparison(records: Sequence[RunRecord], **options: Any) -> SeedComparison:
    """The layer-mean routing statistics of the routed runs over seeds, tested against the reference."""
    columns = {name: layer_mean(name) for name in list(ROUTING_COLUMNS)[:3]}
    return compare_metrics_over_seeds([r for r in records if r.routing], columns, **options)


def routing_seed_table(comparison: SeedComparison) -> Table:
    """The ``routing_seeds`` table of a :func:`routing_seed_comparison`."""
    return seed_metric_table(
        comparison,
        name="routing_seeds",
        what=f"Routing behaviour over seeds, the mean over layers of each run's averages over its measured steps: "
        f"{_ROUTING_TEXT}.",
        labels=ROUTING_HEADERS,
        specs={name: spec for name, (_, spec) in ROUTING_COLUMNS.items()},
    )


# ------------------------------------------------------------------------------------------ efficiency
def _fmt_tflops(value: float | None) -> str:
    """Two decimals as the papers print them; three significant digits for the tiny CPU figures."""
    return _fmt(value, ".2f" if value is None or value >= 1 else ".3g")


def efficiency_table(
    records: Sequence[RunRecord], *, ledger: Sequence[PublishedEntry] | None = None,
    parity_tolerance: float = DEFAULT_PARITY_TOLERANCE, reference_router: str = DEFAULT_REFERENCE_ROUTER,
) -> Table:
    """The training-efficiency table, with a compute-parity verdict per run.

    Args:
        records: runs with efficiency figures (runs without are left out).
        ledger: published numbers to show beside the runs (None: measured rows only).
        parity_tolerance, reference_router: :func:`~repro.report.compute_parity.compute_parity`'s.
    """
    measured = [r for r in _ordered(records) if r.efficiency is not None]
    parity = compute_parity(measured, tolerance=parity_tolerance, reference_router=reference_router)
    labels = _labels(measured)
    rows: list[tuple[str, ...]] = []
    # Published rows once per router, after its last measured row (variants share them).
    last_of_router = {r.experiment.router: r.run_id for r in measured}
    for record in measured:
        e = record.efficiency
        memory = None if e.peak_memory_bytes is None else e.peak_memory_bytes / 2**30
        groups = [layer.group_size for layer in record.routing if layer.group_size is not None]
        rows.append((
            labels[record.run_id], _fmt(e.iter_time_ms, ".1f"), _fmt_tflops(e.tflops_per_device_analytic),
            _fmt_tflops(e.tflops_per_device_measured), _fmt(e.tokens_per_s, ".0f"), _fmt(memory, ".2f"),
            _fmt(e.mean_active_experts, ".3f"), _fmt(mean_or_none(groups), ".0f"),
            str(e.num_devices), record.environment.device, e.backend or MISSING, parity[record.run_id].note,
        ))
        if last_of_router[record.experiment.router] != record.run_id:
            continue
        for source, entries in _published_groups(record, ledger or (), "efficiency.").items():
            setting = next(iter(entries.values())).setting
            rows.append((
                f"{record.experiment.router} [{source}]", _fmt(_value(entries.get("efficiency.iter_time_ms")), ".1f"),
                _fmt_tflops(_value(entries.get("efficiency.tflops_per_device"))), *[MISSING] * 5,
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
        "d head size, f FFN size per expert, V padded vocabulary. Token group: tokens that compete for the experts "
        "together, for routers whose choice couples tokens (Expert Choice; -- for the others). Backend: the modules "
        "megatron-core built (te: TransformerEngine; torch: torch's grouped GEMM and SDPA; local: megatron's local "
        f"spec). Compute parity: measured expert FLOPs per token within +-{parity_tolerance * 100:g}% of the "
        f"reference run (router '{reference_router}' where present)."
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
    """The named FLOPs count(s) behind the records' TFLOP/s (:func:`repro.records.flops.formula_name`)."""
    counts = sorted({r.efficiency.flops_attention or "" for r in records})
    if len(counts) == 1:
        return formula_name(counts[0] or None)
    return "; ".join(
        f"{formula_name(c or None)} ({', '.join(r.run_id for r in records if (r.efficiency.flops_attention or '') == c)})"
        for c in counts
    )


# ------------------------------------------------------------------------------------------ routing
def routing_table(records: Sequence[RunRecord]) -> Table:
    """Routing per run (dense left out): mean over layers, then each layer."""
    routed = [r for r in _ordered(records) if r.routing]
    labels = _labels(routed)
    rows: list[tuple[str, ...]] = []
    for record in routed:
        rows.append((labels[record.run_id], "mean",
                     *(_fmt(layer_mean(n)(record), spec) for n, (_, spec) in ROUTING_COLUMNS.items())))
        rows += [(labels[record.run_id], str(layer.layer + 1),
                  *(_fmt(getattr(layer, n), spec) for n, (_, spec) in ROUTING_COLUMNS.items()))
                 for layer in record.routing]
    headers = ("Router", "Layer", *ROUTING_HEADERS.values())
    caption = (
        "Routing behaviour, averaged over the measured steps, per MoE layer (counted from 1, as in TensorBoard, the "
        f"plots and the write-ups) and their mean: {_ROUTING_TEXT}, the routing-weight mass the dispatch rule "
        "dropped, and the share of tokens dispatched only by a fallback rule (DirMoE: no gate above its threshold, "
        "the arg-max of r taken)."
    )
    return Table("routing", caption, headers, tuple(rows))
