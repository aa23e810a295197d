"""The DirMoE ablation's tables (:mod:`repro.studies.ablation` runs the cells). Per run (:func:`run_metrics`), over
the last ``final_window`` log rows: load and weight imbalance per layer (max / mean over experts; weight imbalance
alone shows a collapse under dense dispatch), layer means of active experts, Simpson index of r and theta, fallback
share; last validation loss and the window's LM loss. Per cell: mean, 95% Student-t interval, and a paired t-test
against the reference cell over shared seeds (:mod:`repro.report.over_seeds`). Unreported metrics are missing.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from repro.records.step_log import LogRow
from repro.report.over_seeds import (
    SeedStat,
    against_reference,
    compare,
    count_defined,
    family_sentence,
    marks_sentence,
    undefined_cells,
    undefined_note,
)
from repro.report.table_core import MISSING, PLUS_MINUS, SIGNIFICANT, Table, fmt_interval, mean_or_none
from repro.stats import Interval, mean_ci

#: The cell every other cell is tested against: DirMoE with the paper's options.
REFERENCE = "paper"
#: The reference level of a router that balances its load.
SWITCH = "switch"
#: Interval coverage and significance level of every table and comparison.
CONFIDENCE, ALPHA = 0.95, 0.05


@dataclass(frozen=True)
class Metric:
    """One ablation-table column: :func:`run_metrics` key (``load_imbalance[0]``), label, format spec."""

    key: str
    label: str
    spec: str


_LAYER_MEAN = (
    ("active_experts", "active experts", ".2f"),
    ("simpson_r", "Simpson r", ".2f"),
    ("simpson_theta", "Simpson theta", ".2f"),
    ("fallback_share", "fallback share", ".2f"),
)


def _metrics_for(keys: Iterable[str]) -> tuple[Metric, ...]:
    """The columns for the MoE layers of :func:`run_metrics` keys (labels number layers from 1)."""
    layers = range(len({k for k in keys if k.startswith("load_imbalance[")}))
    return (
        *(Metric(f"load_imbalance[{i}]", f"load imb. L{i + 1}", ".2f") for i in layers),
        *(Metric(f"weight_imbalance[{i}]", f"weight imb. L{i + 1}", ".2f") for i in layers),
        *(Metric(key, label, spec) for key, label, spec in _LAYER_MEAN),
        Metric("val_loss", "val loss", ".3f"),
        Metric("lm_loss", "LM loss", ".3f"),
    )


def run_metrics(rows: Sequence[LogRow], final_window: int) -> dict[str, float | None]:
    """A run's end-of-run values (module docstring) from its training-log rows, the last ``final_window``
    averaged: ``{metric key: value}``, None where the run does not report the metric."""
    if not rows:
        raise ValueError("run_metrics needs at least one log row")
    if final_window < 1:
        raise ValueError(f"final_window must be >= 1, got {final_window}")
    window = rows[-final_window:]
    num_layers = max(len(r.routing.get("load_imbalance") or []) for r in rows)
    out: dict[str, float | None] = {}
    for layer in range(num_layers):
        loads = [s[layer] for r in window if len(s := r.routing.get("load_imbalance") or []) > layer]
        shares = [s[layer] for r in window if len(s := r.routing_per_expert.get("weight_share") or []) > layer]
        out[f"load_imbalance[{layer}]"] = mean_or_none(loads)
        out[f"weight_imbalance[{layer}]"] = mean_or_none([max(x) * len(x) / sum(x) for x in shares if sum(x) > 0])
    for key, _, _ in _LAYER_MEAN:
        out[key] = mean_or_none([m for m in (r.layer_mean(key) for r in window) if m is not None])
    out["val_loss"] = next((r.val_loss for r in reversed(rows) if r.val_loss is not None), None)
    out["lm_loss"] = statistics.fmean(r.lm_loss for r in window)
    return out


@dataclass(frozen=True)
class AblationResults:
    """cell (table order) -> seed -> metric key -> value (None: not reported); the columns, the rows averaged,
    and what each cell tests (for captions)."""

    cells: tuple[str, ...]
    values: Mapping[str, Mapping[int, Mapping[str, float | None]]]
    metrics: tuple[Metric, ...]
    final_window: int
    readings: Mapping[str, str]

    def seeds(self, cell: str) -> tuple[int, ...]:
        return tuple(sorted(self.values[cell]))

    def per_seed(self, cell: str, key: str) -> dict[int, float]:
        return {s: v[key] for s, v in sorted(self.values[cell].items()) if v.get(key) is not None}

    @property
    def labels(self) -> dict[str, str]:
        return {m.key: m.label for m in self.metrics}

    @property
    def by_cell(self) -> dict[str, dict[str, dict[int, float]]]:
        """cell -> metric key -> seed -> value (:mod:`repro.report.over_seeds`'s values)."""
        return {cell: {m.key: self.per_seed(cell, m.key) for m in self.metrics} for cell in self.cells}


def collect_results(
    logs: Mapping[str, Mapping[int, Sequence[LogRow]]], final_window: int, readings: Mapping[str, str] | None = None
) -> AblationResults:
    """The :class:`AblationResults` of the runs' training logs.

    Args:
        logs: cell -> seed -> the run's log rows (cells in table order).
        final_window: trailing rows of each run averaged.
        readings: cell -> what it tests.
    """
    empty = [cell for cell, runs in logs.items() if not runs]
    if empty:
        raise ValueError(f"cell(s) without runs: {', '.join(empty)}")
    values = {cell: {seed: run_metrics(rows, final_window) for seed, rows in runs.items()} for cell, runs in logs.items()}
    return AblationResults(
        cells=tuple(logs), values=values, final_window=final_window, readings=dict(readings or {}),
        metrics=_metrics_for(k for runs in values.values() for v in runs.values() for k in v),
    )


def compare_cells(results: AblationResults, reference: str, *, family: str = "table") -> dict[str, dict[str, SeedStat]]:
    """Every cell against ``reference`` (no tests when it is not a cell), in every column.

    Args:
        family: the Holm family, ``table`` or ``column`` (:mod:`repro.report.over_seeds`).

    Returns:
        cell -> metric key -> :class:`SeedStat`.
    """
    return against_reference(results.by_cell, [m.key for m in results.metrics],
                             reference if reference in results.cells else None, family=family, confidence=CONFIDENCE)


def compare_cell_pairs(
    results: AblationResults, pairs: Sequence[tuple[str, str]], keys: Sequence[str], *, family: str = "table"
) -> dict[tuple[str, str, str], SeedStat]:
    """Cell against cell, paired over shared seeds (for claims like "X is the main lever").

    Args:
        pairs: ``(a, b)``: differences ``a - b``.
        keys: metric keys compared.
        family: ``table`` (every pair and key one family) or ``column`` (one family per key).

    Returns:
        ``(a, b, key)`` -> :class:`SeedStat` (``difference``: a minus b).
    """
    return compare(results.by_cell, [(a, b, k) for k in keys for a, b in pairs], family=family, confidence=CONFIDENCE)


def _diff_cell(stat: SeedStat, spec: str) -> str:
    """``difference +- half-width (p=adjusted)``, marked; undefined or missing tests as such."""
    if stat.difference is None:
        return MISSING
    if stat.undefined:
        return f"{fmt_interval(stat.difference, spec)} (p undefined)"
    mark = SIGNIFICANT if stat.significant(ALPHA) else ""
    return f"{fmt_interval(stat.difference, spec)} (p={stat.adjusted_p:.2g}){mark}"


def ablation_table(
    results: AblationResults, reference: str = "paper", *, name: str = "ablation", family: str = "table"
) -> Table:
    """Per cell and column: ``mean +- CI half-width`` over seeds (:data:`CONFIDENCE`), marked where it differs
    from ``reference`` (:data:`ALPHA`, Holm-adjusted over ``family``, ``table`` or ``column``); ``name``: file stem.
    """
    stats = compare_cells(results, reference, family=family)
    rows = [
        (f"{cell} (reference)" if cell == reference else cell, ",".join(map(str, results.seeds(cell))),
         *(fmt_interval(stats[cell][m.key].interval, m.spec,
                        SIGNIFICANT if stats[cell][m.key].significant(ALPHA) else "") for m in results.metrics))
        for cell in results.cells
    ]
    caption = (
        f"DirMoE ablation on the embedded default: end-of-run routing and losses per cell, over seeds. Each cell: "
        f"the mean over the seeds {PLUS_MINUS} the half-width of the {CONFIDENCE:.0%} Student-t interval of that "
        f"mean. Routing columns and LM loss: means over the last {results.final_window} training steps; "
        "load imb.: max / mean tokens per expert of a layer (layers from 1); weight imb.: max / mean over experts "
        "of the mean routing weight r (DirMoE only); active experts, Simpson index of r and of the Dirichlet "
        "draws theta, fallback share (tokens dispatched by the arg-max fallback alone): means over layers; val "
        "loss: the last validation. "
    )
    if reference in results.cells:
        test = "a paired t-test over the seeds both cells ran"
        caption += marks_sentence(reference, ALPHA, test, family, stats, "cells", results.labels) + " "
    legend = "; ".join(f"{cell}: {results.readings[cell]}" for cell in results.cells if cell in results.readings)
    caption += f"Cells: {legend}."
    headers = ("Cell", "seeds", *(m.label for m in results.metrics))
    return Table(name, caption, headers, tuple(rows))


#: The columns of the difference table: the collapse and what it costs.
DIFFERENCE_KEYS = ("load_imbalance", "weight_imbalance", "val_loss", "lm_loss")


def difference_metrics(results: AblationResults) -> list[Metric]:
    """The columns of :data:`DIFFERENCE_KEYS` (per layer where per layer)."""
    return [m for m in results.metrics if m.key.split("[")[0] in DIFFERENCE_KEYS]


def ablation_difference_table(results: AblationResults, reference: str = "paper", *, family: str = "table") -> Table:
    """Paired differences to ``reference``: ``mean difference +- CI half-width (Holm-adjusted p)`` per cell, in
    the columns of :func:`difference_metrics`; arguments, tests and Holm family as :func:`ablation_table`'s, so
    both tables mark the same cells."""
    stats = compare_cells(results, reference, family=family)
    metrics = difference_metrics(results)
    rows = [
        (cell, *(_diff_cell(stats[cell][m.key], m.spec) for m in metrics))
        for cell in results.cells if cell != reference
    ]
    caption = (
        f"DirMoE ablation: each cell minus '{reference}', paired by seed. Each cell: the mean of the paired "
        f"differences {PLUS_MINUS} the half-width of their {CONFIDENCE:.0%} Student-t interval, and the "
        f"adjusted p-value of the paired t-test, {family_sentence(family, count_defined(stats), 'cells')}: "
        f"the family of the ablation table against '{reference}', all its columns, of which these are a part; "
        f"{SIGNIFICANT}: p < {ALPHA:g}. Columns as in the ablation table."
    )
    shown = {m.label for m in metrics}
    caption += undefined_note([(c, k) for c, k in undefined_cells(stats, results.labels) if k in shown])
    headers = ("Cell", *(f"{m.label} diff" for m in metrics))
    return Table("ablation_differences", caption, headers, tuple(rows))


def pairs_table(
    results: AblationResults, pairs: Sequence[tuple[str, str]], *, keys: Sequence[str] | None = None,
    family: str = "table",
) -> Table:
    """Cell against cell (:func:`compare_cell_pairs`): ``a - b`` per pair and column, with the adjusted p.

    Args:
        pairs: ``(a, b)`` pairs of cells, a row each.
        keys: metric keys (default: the difference table's columns).
        family: ``table`` (every pair and column) or ``column``.
        results: as in :func:`ablation_difference_table`.
    """
    metrics = [m for m in results.metrics if m.key in keys] if keys is not None else difference_metrics(results)
    stats = compare_cell_pairs(results, pairs, [m.key for m in metrics], family=family)
    rows = [(f"{a} - {b}", *(_diff_cell(stats[(a, b, m.key)], m.spec) for m in metrics)) for a, b in pairs]
    caption = (
        "DirMoE ablation, cell against cell: the first cell minus the second, paired by the seeds both ran."
        f" Each cell: the mean of the paired differences {PLUS_MINUS} the half-width of their "
        f"{CONFIDENCE:.0%} Student-t interval, and the p-value of the paired t-test, "
        f"{family_sentence(family, sum(s.defined for s in stats.values()), 'pairs')}; {SIGNIFICANT}: "
        f"p < {ALPHA:g}. Columns as in the ablation table."
    )
    caption += undefined_note([(f"{a} - {b}", results.labels[k]) for (a, b, k), s in stats.items() if s.undefined])
    headers = ("Cells", *(f"{m.label} diff" for m in metrics))
    return Table("ablation_pairs", caption, headers, tuple(rows))


@dataclass(frozen=True)
class Hypothesis:
    """A pre-registered comparison: ``cell - versus`` in metric ``key``, the claim in words, and the predicted
    direction (``lower``: below zero; None: any). The test is two-sided; a prediction lets the write-up call a
    significant difference the other way a refutation."""

    cell: str
    versus: str
    key: str
    claim: str
    expect: str | None = None

    def __post_init__(self) -> None:
        if self.expect not in (None, "lower", "higher"):
            raise ValueError(f"hypothesis expect must be 'lower', 'higher' or None, got {self.expect!r}")


def confirm_table(results: AblationResults, hypotheses: Sequence[Hypothesis]) -> Table:
    """Pre-registered hypotheses on seeds outside the screen, one Holm family over them only: a row per
    hypothesis, ``cell - versus`` with its interval and adjusted p-value.

    Args:
        results: the confirmatory runs' values.
        hypotheses: fixed in advance (those with unrun cells are left out; the caption says so).
    """
    tested = [h for h in hypotheses if h.cell in results.cells and h.versus in results.cells]
    stats = compare(results.by_cell, [(h.cell, h.versus, h.key) for h in tested], family="table", confidence=CONFIDENCE)
    specs = {m.key: m.spec for m in results.metrics}
    column = {h: results.labels.get(h.key, h.key) for h in hypotheses}
    rows = [
        (h.claim, f"{h.cell} - {h.versus}", column[h],
         _diff_cell(stats[(h.cell, h.versus, h.key)], specs.get(h.key, ".3f")))
        for h in tested
    ]
    defined = sum(s.defined for s in stats.values())
    seeds = sorted({s for cell in results.cells for s in results.seeds(cell)})
    caption = (
        f"DirMoE ablation, confirmatory: the hypotheses stated before these seeds ({', '.join(map(str, seeds))}) "
        "were run, tested on them alone. Each row: the first cell minus the second, paired by seed; the mean of "
        f"the differences {PLUS_MINUS} the half-width of their {CONFIDENCE:.0%} Student-t interval and the "
        f"p-value of the paired t-test, Holm-adjusted over the {defined} hypotheses of this table (family: the "
        f"pre-registered hypotheses, fixed before the runs); {SIGNIFICANT}: p < {ALPHA:g}, two-sided."
    )
    left = [f"{h.cell} - {h.versus} ({column[h]})" for h in hypotheses if h not in tested]
    if left:
        caption += f" Not tested (a cell not run): {'; '.join(left)}."
    caption += undefined_note([(f"{h.cell} - {h.versus}", column[h]) for h in tested
                               if stats[(h.cell, h.versus, h.key)].undefined])
    return Table("ablation_confirm", caption, ("Claim", "Cells", "Column", "Difference (p)"), tuple(rows))


def _interval_json(interval: Interval | None) -> dict[str, Any] | None:
    if interval is None:
        return None
    return {"mean": interval.estimate, "ci95": None if interval.low is None else [interval.low, interval.high]}


def _versus_json(stat: SeedStat) -> dict[str, Any] | None:
    if stat.test is None:
        return None
    return {
        "difference": _interval_json(stat.difference),
        "t": stat.test.statistic if stat.test.defined else None,
        "p": stat.test.p_value if stat.test.defined else None,
        "p_holm": stat.adjusted_p,
        "significant": stat.significant(ALPHA),
        **({"undefined": "every paired difference the same"} if stat.undefined else {}),
    }


def results_to_json(
    results: AblationResults, *, reference: str, switch: str | None = None, family: str = "table"
) -> dict[str, Any]:
    """The results as JSON, with paired comparisons against ``reference`` and ``switch`` (where they are cells);
    ``significant`` at :data:`ALPHA`.

    Args:
        family: the Holm family of each reference's comparisons (as in :func:`ablation_table`).

    Returns:
        ``{cell: {"seeds": [...], metric key: {"values", "mean", "ci95", "vs_<reference>", "vs_<switch>"}}}``;
        ``p``/``t`` are null where the test is undefined.
    """
    versus = {ref: compare_cells(results, ref, family=family) for ref in (reference, switch)
              if ref is not None and ref in results.cells}
    out: dict[str, Any] = {}
    for cell in results.cells:
        entry: dict[str, Any] = {"seeds": list(results.seeds(cell))}
        for metric in results.metrics:
            values = results.per_seed(cell, metric.key)
            item: dict[str, Any] = {"values": {str(s): v for s, v in values.items()}}
            item.update(_interval_json(mean_ci(list(values.values())) if values else None) or {"mean": None, "ci95": None})
            for ref, stats in versus.items():
                if ref != cell:
                    item[f"vs_{ref}"] = _versus_json(stats[cell][metric.key])
            entry[metric.key] = item
        out[cell] = entry
    return out


def results_from_json(summary: Mapping[str, Any]) -> AblationResults:
    """The :class:`AblationResults` in a parsed ``summary.json`` (tables rebuilt without run directories)."""
    stored = summary["results"]
    values: dict[str, dict[int, dict[str, float | None]]] = {}
    for cell, entry in stored.items():
        runs = values.setdefault(cell, {int(seed): {} for seed in entry["seeds"]})
        for key, item in ((k, v) for k, v in entry.items() if k != "seeds"):
            for seed, value in item["values"].items():
                runs[int(seed)][key] = value
    readings = {cell: spec["reading"] for cell, spec in summary.get("cells", {}).items() if "reading" in spec}
    return AblationResults(cells=tuple(stored), values=values, final_window=int(summary["final_window_steps"]),
                           readings=readings, metrics=_metrics_for(k for entry in stored.values() for k in entry))


def summary_intervals(
    results: AblationResults, keys: Sequence[str]
) -> dict[str, dict[str, tuple[float, float | None, float | None]]]:
    """``{cell: {column label: (mean, low, high)}}`` for ``keys``, for the summary plot (missing values left out)."""
    cis = {cell: {results.labels[k]: mean_ci(list(v.values()), CONFIDENCE) for k in keys
                  if (v := results.per_seed(cell, k))} for cell in results.cells}
    return {cell: {label: (ci.estimate, ci.low, ci.high) for label, ci in c.items()} for cell, c in cis.items() if c}
