"""The DirMoE ablation's tables: per cell, the end-of-run routing and losses over seeds, tested against a
reference cell (:mod:`repro.ablation` runs the cells).

Per run, from its training log (:func:`run_metrics`), over the last ``final_window`` rows (the end state):

- ``load_imbalance[l]``: max / mean tokens per expert of layer l (the routers' shared metric);
- ``weight_imbalance[l]``: max / mean over experts of the mean routing weight ``mean_t r_ti`` (DirMoE's
  per-expert ``weight_share``; E x its largest entry). With dense dispatch the load is flat by
  construction and only this shows a collapse;
- ``active_experts``, ``simpson_r`` (Simpson index of DirMoE's full routing weights r), ``simpson_theta``
  (of its Dirichlet draws), ``fallback_share`` (tokens dispatched by the threshold rule's arg-max alone):
  means over layers;
- ``val_loss``: the validation loss of the last evaluation; ``lm_loss``: the training LM loss over the window.

Per cell over its seeds (:func:`compare_cells`): the mean and the half-width of its 95% Student-t interval
(:func:`repro.report.stats.mean_ci`); a paired t-test over the seeds the cell shares with the reference cell
(:func:`repro.report.stats.paired_t_test`: same seed, same data order and initial backbone), Holm-adjusted over
the cells of a column (:func:`repro.report.stats.holm`); and the Student-t interval of the paired differences.
A cell is marked where the adjusted p-value is below alpha (0.05). Metrics a router does not report (Switch has
no Dirichlet) are missing, not zero.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from repro.report.stats import Interval, PairedTest, holm, mean_ci, paired_t_test
from repro.report.table_core import MISSING, PLUS_MINUS, SIGNIFICANT, Table
from repro.training.log import LogRow


@dataclass(frozen=True)
class Metric:
    """One column of the ablation table.

    Args:
        key: the value's key in :func:`run_metrics` (``load_imbalance[0]``).
        label: the column label.
        spec: format spec of its numbers.
    """

    key: str
    label: str
    spec: str


_LAYER_MEAN = (
    ("active_experts", "active experts", ".2f"),
    ("simpson_r", "Simpson r", ".2f"),
    ("simpson_theta", "Simpson theta", ".2f"),
    ("fallback_share", "fallback share", ".2f"),
)


def metrics_for(num_layers: int) -> tuple[Metric, ...]:
    """The table's columns for a model with ``num_layers`` MoE layers (layers numbered from 1 in labels)."""
    layers = range(num_layers)
    return (
        *(Metric(f"load_imbalance[{i}]", f"load imb. L{i + 1}", ".2f") for i in layers),
        *(Metric(f"weight_imbalance[{i}]", f"weight imb. L{i + 1}", ".2f") for i in layers),
        *(Metric(key, label, spec) for key, label, spec in _LAYER_MEAN),
        Metric("val_loss", "val loss", ".3f"),
        Metric("lm_loss", "LM loss", ".3f"),
    )


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def run_metrics(rows: Sequence[LogRow], final_window: int) -> dict[str, float | None]:
    """A run's end-of-run values (module docstring), from its training-log rows.

    Args:
        rows: the run's log rows.
        final_window: rows at the end averaged (the last ``final_window``).

    Returns:
        ``{metric key: value}``; None where the run does not report the metric.

    Raises:
        ValueError: no rows, or ``final_window < 1``.
    """
    if not rows:
        raise ValueError("run_metrics needs at least one log row")
    if final_window < 1:
        raise ValueError(f"final_window must be >= 1, got {final_window}")
    window = rows[-final_window:]
    num_layers = max(len(r.routing.get("load_imbalance") or []) for r in rows)
    out: dict[str, float | None] = {}
    for layer in range(num_layers):
        out[f"load_imbalance[{layer}]"] = _mean(
            [r.routing["load_imbalance"][layer] for r in window if len(r.routing.get("load_imbalance") or []) > layer]
        )
        ratios = []
        for r in window:
            shares = (r.routing_per_expert.get("weight_share") or [])
            if len(shares) > layer and sum(shares[layer]) > 0:
                ratios.append(max(shares[layer]) * len(shares[layer]) / sum(shares[layer]))
        out[f"weight_imbalance[{layer}]"] = _mean(ratios)
    for key, _, _ in _LAYER_MEAN:
        out[key] = _mean([m for m in (r.layer_mean(key) for r in window) if m is not None])
    val = [r.val_loss for r in rows if r.val_loss is not None]
    out["val_loss"] = val[-1] if val else None
    out["lm_loss"] = statistics.fmean(r.lm_loss for r in window)
    return out


@dataclass(frozen=True)
class AblationResults:
    """Every run's end-of-run values, by cell and seed.

    Args:
        cells: the cells, in table order.
        values: cell -> seed -> metric key -> value (None: not reported).
        metrics: the columns.
        final_window: rows the end-of-run values average.
        readings: cell -> what it tests (for captions).
    """

    cells: tuple[str, ...]
    values: Mapping[str, Mapping[int, Mapping[str, float | None]]]
    metrics: tuple[Metric, ...]
    final_window: int
    readings: Mapping[str, str]

    def seeds(self, cell: str) -> tuple[int, ...]:
        """The cell's seeds, sorted."""
        return tuple(sorted(self.values[cell]))

    def per_seed(self, cell: str, key: str) -> dict[int, float]:
        """``{seed: value}`` of one metric, the seeds that report it."""
        return {s: v[key] for s, v in sorted(self.values[cell].items()) if v.get(key) is not None}


def collect_results(
    logs: Mapping[str, Mapping[int, Sequence[LogRow]]],
    final_window: int,
    readings: Mapping[str, str] | None = None,
) -> AblationResults:
    """The :class:`AblationResults` of the runs' training logs.

    Args:
        logs: cell -> seed -> the run's log rows (cells in table order).
        final_window: rows at the end of each run that the routing metrics and the LM loss average.
        readings: cell -> what it tests.

    Returns:
        The results.

    Raises:
        ValueError: a cell without runs.
    """
    empty = [cell for cell, runs in logs.items() if not runs]
    if empty:
        raise ValueError(f"cell(s) without runs: {', '.join(empty)}")
    values = {cell: {seed: run_metrics(rows, final_window) for seed, rows in runs.items()} for cell, runs in logs.items()}
    num_layers = max(sum(k.startswith("load_imbalance[") for k in v) for runs in values.values() for v in runs.values())
    return AblationResults(
        cells=tuple(logs), values=values, metrics=metrics_for(num_layers), final_window=final_window,
        readings=dict(readings or {}),
    )


@dataclass(frozen=True)
class CellStat:
    """One cell's value in one column, over its seeds, and its comparison with the reference cell.

    Args:
        interval: mean and Student-t interval over the seeds (None: no seed reports the metric).
        test: paired t-test against the reference over the shared seeds (None: the reference itself, or
            fewer than two shared seeds).
        adjusted_p: the test's p-value after Holm's adjustment over the cells of the column.
        difference: mean and Student-t interval of the paired differences (cell minus reference).
    """

    interval: Interval | None
    test: PairedTest | None = None
    adjusted_p: float | None = None
    difference: Interval | None = None


def compare_cells(
    results: AblationResults, reference: str, confidence: float = 0.95
) -> dict[str, dict[str, CellStat]]:
    """Every cell against ``reference``, column by column (module docstring).

    Args:
        results: the runs' values.
        reference: the reference cell (no tests when it is not among the cells).
        confidence: coverage of the intervals.

    Returns:
        cell -> metric key -> :class:`CellStat`.
    """
    out: dict[str, dict[str, CellStat]] = {cell: {} for cell in results.cells}
    for metric in results.metrics:
        tests: dict[str, tuple[PairedTest, Interval]] = {}
        if reference in results.cells:
            ref = results.per_seed(reference, metric.key)
            for cell in results.cells:
                if cell == reference:
                    continue
                other = results.per_seed(cell, metric.key)
                shared = sorted(set(ref) & set(other))
                if len(shared) >= 2:
                    a, b = [ref[s] for s in shared], [other[s] for s in shared]
                    tests[cell] = (paired_t_test(a, b), mean_ci([y - x for x, y in zip(a, b)], confidence))
        adjusted = dict(zip(tests, holm([t.p_value for t, _ in tests.values()]))) if tests else {}
        for cell in results.cells:
            values = list(results.per_seed(cell, metric.key).values())
            test, diff = tests.get(cell, (None, None))
            out[cell][metric.key] = CellStat(
                mean_ci(values, confidence) if values else None, test, adjusted.get(cell), diff
            )
    return out


def _num(value: float | None, spec: str) -> str:
    if value is None or not math.isfinite(value):
        return MISSING
    text = format(value, spec)
    return format(0.0, spec) if float(text) == 0 else text  # no "-0.00" from rounding


def _pm(interval: Interval | None, spec: str, mark: str = "") -> str:
    if interval is None:
        return MISSING
    if interval.half_width is None:
        return _num(interval.estimate, spec) + mark
    return f"{_num(interval.estimate, spec)} {PLUS_MINUS} {_num(interval.half_width, spec)}{mark}"


def _legend(results: AblationResults) -> str:
    return "; ".join(f"{cell}: {results.readings[cell]}" for cell in results.cells if cell in results.readings)


def ablation_table(
    results: AblationResults,
    reference: str = "paper",
    *,
    name: str = "ablation",
    confidence: float = 0.95,
    alpha: float = 0.05,
) -> Table:
    """Per cell and column: ``mean +- CI half-width`` over the seeds, marked where it differs from ``reference``.

    Args:
        results: the runs' values.
        reference: the cell the others are tested against.
        name: the table's file stem.
        confidence: coverage of the intervals.
        alpha: significance level of the marks (after Holm's adjustment over the cells of a column).

    Returns:
        The :class:`Table`.
    """
    stats = compare_cells(results, reference, confidence)
    rows = []
    for cell in results.cells:
        label = f"{cell} (reference)" if cell == reference else cell
        row = [label, ",".join(map(str, results.seeds(cell)))]
        for metric in results.metrics:
            stat = stats[cell][metric.key]
            mark = SIGNIFICANT if stat.adjusted_p is not None and stat.adjusted_p < alpha else ""
            row.append(_pm(stat.interval, metric.spec, mark))
        rows.append(tuple(row))
    caption = (
        f"DirMoE ablation on the embedded default: end-of-run routing and losses per cell, over seeds. Each cell: "
        f"the mean over the seeds {PLUS_MINUS} the half-width of the {confidence:.0%} Student-t interval of that "
        f"mean. Routing columns and LM loss: means over the last {results.final_window} training steps; "
        "load imb.: max / mean tokens per expert of a layer (layers from 1); weight imb.: max / mean over experts "
        "of the mean routing weight r (DirMoE only); active experts, Simpson index of r and of the Dirichlet "
        "draws theta, fallback share (tokens dispatched by the arg-max fallback alone): means over layers; val "
        "loss: the last validation. "
    )
    if reference in results.cells:
        caption += (
            f"{SIGNIFICANT}: differs from '{reference}' at alpha = {alpha:g} by a paired t-test over the seeds both "
            "cells ran, Holm-adjusted over the cells of the column. "
        )
    caption += f"Cells: {_legend(results)}."
    headers = ("Cell", "seeds", *(m.label for m in results.metrics))
    return Table(name, caption, headers, tuple(rows))


#: The columns of the difference table: the collapse and what it costs.
DIFFERENCE_KEYS = ("load_imbalance", "weight_imbalance", "val_loss", "lm_loss")


def ablation_difference_table(
    results: AblationResults,
    reference: str = "paper",
    *,
    name: str = "ablation_differences",
    confidence: float = 0.95,
    alpha: float = 0.05,
) -> Table:
    """Paired differences to ``reference``: ``mean difference +- CI half-width (Holm-adjusted p)`` per cell.

    Args:
        results: the runs' values.
        reference: the cell the others are compared with.
        name: the table's file stem.
        confidence: coverage of the intervals of the paired differences.
        alpha: significance level of the marks.

    Returns:
        The :class:`Table` (columns: load and weight imbalance per layer, validation and LM loss).
    """
    stats = compare_cells(results, reference, confidence)
    metrics = [m for m in results.metrics if m.key.split("[")[0] in DIFFERENCE_KEYS]
    rows = []
    for cell in results.cells:
        if cell == reference:
            continue
        row = [cell]
        for metric in metrics:
            stat = stats[cell][metric.key]
            if stat.difference is None or stat.adjusted_p is None:
                row.append(MISSING)
                continue
            mark = SIGNIFICANT if stat.adjusted_p < alpha else ""
            row.append(f"{_pm(stat.difference, metric.spec)} (p={stat.adjusted_p:.2g}){mark}")
        rows.append(tuple(row))
    caption = (
        f"DirMoE ablation: each cell minus '{reference}', paired by seed. Each cell: the mean of the paired "
        f"differences {PLUS_MINUS} the half-width of their {confidence:.0%} Student-t interval, and the "
        f"Holm-adjusted p-value of the paired t-test (over the cells of the column); {SIGNIFICANT}: p < {alpha:g}. "
        "Columns as in the ablation table."
    )
    headers = ("Cell", *(f"{m.label} diff" for m in metrics))
    return Table(name, caption, headers, tuple(rows))


def _interval_json(interval: Interval | None) -> dict[str, Any] | None:
    if interval is None:
        return None
    return {"mean": interval.estimate, "ci95": None if interval.low is None else [interval.low, interval.high]}


def _versus_json(stat: CellStat, alpha: float) -> dict[str, Any] | None:
    if stat.test is None:
        return None
    return {
        "difference": _interval_json(stat.difference),
        "t": stat.test.statistic,
        "p": stat.test.p_value,
        "p_holm": stat.adjusted_p,
        "significant": stat.adjusted_p is not None and stat.adjusted_p < alpha,
    }


def results_to_json(
    results: AblationResults, *, reference: str, switch: str | None = None, alpha: float = 0.05
) -> dict[str, Any]:
    """The results as JSON: per cell and metric, the per-seed values, the mean and interval, and the paired
    comparisons with ``reference`` and with ``switch`` (where they are cells).

    Args:
        results: the runs' values.
        reference: the reference cell.
        switch: a second reference (Switch's level), or None.
        alpha: significance level of the ``significant`` flags.

    Returns:
        ``{cell: {"seeds": [...], metric key: {"values", "mean", "ci95", "vs_<reference>", "vs_<switch>"}}}``.
    """
    versus = {ref: compare_cells(results, ref) for ref in (reference, switch) if ref is not None and ref in results.cells}
    out: dict[str, Any] = {}
    for cell in results.cells:
        entry: dict[str, Any] = {"seeds": list(results.seeds(cell))}
        for metric in results.metrics:
            values = results.per_seed(cell, metric.key)
            item: dict[str, Any] = {"values": {str(s): v for s, v in values.items()}}
            item.update(_interval_json(mean_ci(list(values.values())) if values else None) or {"mean": None, "ci95": None})
            for ref, stats in versus.items():
                if ref != cell:
                    item[f"vs_{ref}"] = _versus_json(stats[cell][metric.key], alpha)
            entry[metric.key] = item
        out[cell] = entry
    return out


def summary_intervals(
    results: AblationResults, keys: Sequence[str], confidence: float = 0.95
) -> dict[str, dict[str, tuple[float, float | None, float | None]]]:
    """``{cell: {column label: (mean, low, high)}}`` of some columns, for the summary plot.

    Args:
        results: the runs' values.
        keys: metric keys.
        confidence: coverage of the intervals.

    Returns:
        The intervals (cells without a value left out of that column).
    """
    labels = {m.key: m.label for m in results.metrics}
    out: dict[str, dict[str, tuple[float, float | None, float | None]]] = {}
    for cell in results.cells:
        for key in keys:
            values = list(results.per_seed(cell, key).values())
            if values:
                ci = mean_ci(values, confidence)
                out.setdefault(cell, {})[labels[key]] = (ci.estimate, ci.low, ci.high)
    return out


__all__ = [
    "AblationResults",
    "CellStat",
    "DIFFERENCE_KEYS",
    "Metric",
    "ablation_difference_table",
    "ablation_table",
    "collect_results",
    "compare_cells",
    "metrics_for",
    "results_to_json",
    "run_metrics",
    "summary_intervals",
]
