"""Regression checks: a run against the published numbers (each original ledger entry for its router and model,
within the entry's tolerance; efficiency only on the same accelerator), against an earlier run (point by point
at a tight relative tolerance: CPU runs are deterministic), or against earlier seeds of its experiment.

Against seeds (:func:`check_against_seeds`; docs/evaluation.md, "Regression check over seeds"), each of K numbers
must fall in the seeds' prediction interval at coverage ``1 - alpha/K`` (Bonferroni: false-alarm rate <= ``alpha``
under any dependence; Holm gives the same verdict; Hotelling's T^2 needs more seeds than numbers).
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tabulate import tabulate

from repro.errors import ReproError
from repro.records.run_record import RunRecord, lm_eval_metrics
from repro.report.published import PublishedEntry, select
from repro.report.table_core import PAPER_TASKS, choose_metric, mean_or_none, record_partial
from repro.schema import flatten
from repro.stats import grid_sd_floor, minimum_detectable_shift, prediction_bounds, prediction_interval

OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"
#: A run's final training loss averages this many last logged losses (single steps are noisy).
FINAL_LOSS_STEPS = 10
#: The power at which a seed check's detectable shift is stated.
DETECTION_POWER = 0.8
#: lm-eval metrics that are a mean of 0/1 scores over the questions: they move in steps of 1/questions.
COUNTED_METRICS = ("acc", "acc_norm", "exact_match")
#: Extra seed spreads (in steps) tried for stepped numbers; few tied seeds say little, so the worst is reported.
STEP_SPREADS = (0.25, 0.5, 1.0, 2.0)
#: Draws of :func:`simulated_false_alarm` in a report (Monte Carlo error <= 0.0016 at rate 0.05).
VALIDATION_DRAWS = 20_000


@dataclass(frozen=True)
class CheckRow:
    """One comparison: the run's value (None: not measured) against a reference within a tolerance (text), its
    status (``ok``, ``FAIL``, ``skipped``) and why, if not obvious.

    Args:
        detectable: seed checks: smallest shift caught with :data:`DETECTION_POWER` (None: not applicable).
    """

    run_id: str
    metric: str
    measured: float | None
    reference: float | None
    tolerance: str
    source: str
    status: str
    note: str = ""
    detectable: float | None = None

    @property
    def delta(self) -> float | None:
        return None if self.measured is None or self.reference is None else self.measured - self.reference


@dataclass(frozen=True)
class CheckReport:
    """The rows of one check and what it guarantees (a seed check's family-wise false-alarm rate)."""

    rows: tuple[CheckRow, ...]
    header: str = ""

    @property
    def passed(self) -> bool:
        return all(r.status != FAIL for r in self.rows)

    @property
    def compared(self) -> int:
        return sum(r.status != SKIPPED for r in self.rows)


def record_value(record: RunRecord, metric: str, zero_shot_metric: str = "auto") -> float | None:
    """A run's value of a shared metric name (see :mod:`repro.report.published`).

    Args:
        metric: ``zero_shot.<task>``, ``zero_shot.avg``, ``efficiency.iter_time_ms``,
            ``efficiency.tflops_per_device`` (analytic FLOPs, as the papers) or ``loss.validation``.
        zero_shot_metric: ``auto``, ``acc`` or ``acc_norm`` (:func:`repro.report.table_core.choose_metric`).

    Returns:
        The value (zero-shot in percent), or None if not measured.
    """
    if metric.startswith("zero_shot."):
        task = metric.removeprefix("zero_shot.")
        if task == "avg":
            return mean_or_none([record_value(record, f"zero_shot.{t}", zero_shot_metric) for t in PAPER_TASKS])
        value = lm_eval_metrics(record).get(task, {}).get(choose_metric(task, [record], zero_shot_metric))
        return None if value is None else 100 * value
    if metric == "loss.validation":
        return record.validation_loss
    if record.efficiency is None:
        return None
    if metric == "efficiency.iter_time_ms":
        return record.efficiency.iter_time_ms
    if metric == "efficiency.tflops_per_device":
        return record.efficiency.tflops_per_device_analytic
    raise ReproError(f"unknown metric '{metric}'")


def _partial(record: RunRecord, metric: str) -> str:
    """The note for a zero-shot number of a task scored on part of its documents ('' otherwise)."""
    task = metric.removeprefix("zero_shot.") if metric.startswith("zero_shot.") else metric.partition("/")[0]
    partial = record_partial(record)
    cut = [partial[task]] if task in partial else list(partial.values()) if task == "avg" else []
    return "partial evaluation: " + "; ".join(p.describe() for p in cut) if cut else ""


def _noted(row: CheckRow, record: RunRecord, references: Sequence[RunRecord] = ()) -> CheckRow:
    """``row`` with a note where either run scored the task on part of its documents (not like-for-like)."""
    notes = [_partial(record, row.metric)]
    notes += [f"reference {ref.run_id}: {n}" for ref in references if (n := _partial(ref, row.metric))]
    note = "; ".join(n for n in (row.note, *notes) if n)
    return row if note == row.note else dataclasses.replace(row, note=note)


def _accelerator(name: str) -> str | None:
    """The accelerator model in a device name (``H100`` in ``NVIDIA H100 80GB HBM3``)."""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", name)
    return match.group(1) if match else None


def check_against_published(
    record: RunRecord, ledger: Sequence[PublishedEntry], *, zero_shot_metric: str = "auto", paper: str | None = None
) -> CheckReport:
    """Compare a run with every original published number for its router and model.

    Args:
        zero_shot_metric: lm-eval metric compared with the papers' accuracies (:func:`record_value`).
        paper: keep only entries whose ``paper`` contains this text (case-insensitive).

    Returns:
        The report (no rows when no ledger entry matches).
    """
    entries = select(ledger, router=record.experiment.router, model_id=record.experiment.model, originals_only=True)
    if paper is not None:
        entries = [e for e in entries if paper.lower() in e.paper.lower()]
    rows = []
    for entry in entries:
        measured = record_value(record, entry.metric, zero_shot_metric)
        common = dict(run_id=record.run_id, metric=entry.metric, measured=measured, reference=entry.value,
                      tolerance=entry.tolerance.describe(), source=entry.measured_in)
        wanted = _accelerator(entry.setting.hardware or "") if entry.metric.startswith("efficiency.") else None
        if wanted is not None and _accelerator(record.environment.device) != wanted:
            status, note = SKIPPED, f"published on {entry.setting.hardware}, run on {record.environment.device}"
        elif measured is None:
            status, note = SKIPPED, "not measured in this run"
        else:
            status, note = OK if entry.tolerance.allows(measured, entry.value) else FAIL, ""
        rows.append(_noted(CheckRow(**common, status=status, note=note), record))
    return CheckReport(tuple(rows))


def check_against_run(
    record: RunRecord, previous: RunRecord, *, loss_rtol: float = 1e-6, eval_rtol: float = 1e-6, atol: float = 1e-12
) -> CheckReport:
    """Compare a run with an earlier run of the same experiment.

    Args:
        loss_rtol: relative tolerance on loss-curve points and the validation loss.
        eval_rtol: relative tolerance on lm-eval metrics.
        atol: absolute tolerance added to both (for values at zero).

    Returns:
        The report: a row for the loss curve (largest deviation), the validation loss, each lm-eval metric.
    """
    rows = []
    tol_loss = f"rtol {loss_rtol:g}"
    new_curve = {p.step: p.loss for p in record.loss_curve}
    old_curve = {p.step: p.loss for p in previous.loss_curve}
    base = dict(run_id=record.run_id, source=f"run {previous.run_id}")
    if new_curve.keys() != old_curve.keys():
        missing = sorted(old_curve.keys() ^ new_curve.keys())
        rows.append(CheckRow(**base, metric=f"loss curve ({len(new_curve)} steps)", measured=None, reference=None,
                             tolerance=tol_loss, status=FAIL, note=f"logged steps differ (e.g. step {missing[0]})"))
    elif new_curve:
        worst = max(new_curve, key=lambda s: abs(new_curve[s] - old_curve[s]))
        ok = all(math.isclose(new_curve[s], old_curve[s], rel_tol=loss_rtol, abs_tol=atol) for s in new_curve)
        rows.append(CheckRow(**base, metric=f"loss curve ({len(new_curve)} steps), worst step {worst}",
                             measured=new_curve[worst], reference=old_curve[worst], tolerance=tol_loss,
                             status=OK if ok else FAIL))
    rows.append(_pair_row(base, "loss.validation", record.validation_loss, previous.validation_loss, loss_rtol, atol))
    new_eval, old_eval = lm_eval_metrics(record), lm_eval_metrics(previous)
    for task in sorted(new_eval.keys() | old_eval.keys()):
        new_m, old_m = new_eval.get(task, {}), old_eval.get(task, {})
        for name in sorted(new_m.keys() | old_m.keys()):
            rows.append(_pair_row(base, f"{task}/{name}", new_m.get(name), old_m.get(name), eval_rtol, atol))
    return CheckReport(tuple(_noted(r, record, (previous,)) for r in rows if r is not None))


def _pair_row(base: dict, metric: str, new: float | None, old: float | None, rtol: float, atol: float) -> CheckRow | None:
    if new is None and old is None:
        return None
    note = "missing in this run" if new is None else "missing in the earlier run" if old is None else ""
    ok = not note and math.isclose(new, old, rel_tol=rtol, abs_tol=atol)
    return CheckRow(**base, metric=metric, measured=new, reference=old, tolerance=f"rtol {rtol:g}",
                    status=OK if ok else FAIL, note=note)


def final_loss(record: RunRecord, steps: int = FINAL_LOSS_STEPS) -> float | None:
    """Mean of the last ``steps`` logged training losses (None: no loss curve)."""
    return mean_or_none([p.loss for p in sorted(record.loss_curve, key=lambda p: p.step)[-steps:]])


def _seed_metrics(record: RunRecord) -> dict[str, float | None]:
    return {
        f"loss.final (mean of last {FINAL_LOSS_STEPS} steps)": final_loss(record),
        "loss.validation": record.validation_loss,
        **{f"{task}/{name}": value for task, metrics in lm_eval_metrics(record).items()
           for name, value in metrics.items()},
    }


def _resolutions(record: RunRecord) -> dict[str, float]:
    """The step (1 / questions scored) of each :data:`COUNTED_METRICS` number."""
    out = {}
    counts = (record.lm_eval or {}).get("n-samples") or {}
    for task, metrics in lm_eval_metrics(record).items():
        for name in [n for n in metrics if n in COUNTED_METRICS]:
            scores = (record.per_question or {}).get(task, {}).get(name)
            questions = len(scores) if scores else (counts.get(task) or {}).get("effective")
            if questions:
                out[f"{task}/{name}"] = 1.0 / questions
    return out


def simulated_false_alarm(
    spreads: Sequence[float], resolutions: Sequence[float], seeds: int, *, alpha: float = 0.05,
    draws: int = VALIDATION_DRAWS, seed: int = 0,
) -> float:
    """Simulated family-wise false-alarm rate of :func:`check_against_seeds`: the fraction of honest new runs
    failing at least one of K bands. Numbers are drawn independently (where Bonferroni is tightest): continuous
    ones from a normal law, stepped ones as a normal count of steps rounded around a centre uniform within a step;
    ``seeds`` draws make the band, one more is checked.

    Args:
        spreads: each number's standard deviation over seeds (matters only for stepped numbers).
        resolutions: each number's step (0: continuous).
        seeds: earlier runs per band (>= 2).
        alpha: the family-wise rate the bands are set for.
        draws: simulated checks.
        seed: generator seed (deterministic answer).

    Returns:
        The fraction of draws with some number outside its band.
    """
    if len(spreads) != len(resolutions) or not spreads:
        raise ValueError("need one spread and one resolution per number, at least one number")
    rng = np.random.default_rng(seed)
    confidence = family_confidence(alpha, len(spreads))
    failed = np.zeros(draws, dtype=bool)
    for spread, step in zip(spreads, resolutions):
        if step > 0:
            centre = rng.uniform(0.0, 1.0, (draws, 1))
            x = np.round(rng.normal(centre, spread / step, (draws, seeds + 1)))  # counts of steps
        else:
            x = rng.normal(0.0, 1.0, (draws, seeds + 1))
        low, high = prediction_bounds(x[:, :seeds], confidence, 1.0 if step > 0 else 0.0)
        new = x[:, seeds]
        failed |= (new < low - 1e-9) | (new > high + 1e-9)
    return float(failed.mean())


def family_confidence(alpha: float, count: int) -> float:
    """Per-band coverage keeping the family-wise rate at ``alpha`` over ``count`` bands: ``1 - alpha / count``."""
    if not 0 < alpha < 1 or count < 1:
        raise ValueError(f"need alpha in (0, 1) and count >= 1, got alpha={alpha}, count={count}")
    return 1 - alpha / count


def check_against_seeds(
    record: RunRecord, previous: Sequence[RunRecord], *, alpha: float = 0.05, atol: float = 1e-12
) -> CheckReport:
    """Compare a run with earlier runs of the same experiment, one per seed, at a family-wise false-alarm rate.

    Args:
        previous: earlier runs with other seeds (at least two).
        alpha: family-wise false-alarm rate (module docstring): each of K bands has coverage ``1 - alpha / K``.
        atol: absolute slack added to both ends (for values equal up to rounding).

    Returns:
        A row per number (final training and validation loss, each lm-eval metric) with its detectable shift; a
        number the new run lacks fails, one measured by fewer than two earlier runs is skipped. The header states
        K, the nominal rate and :func:`simulated_false_alarm`'s (for stepped numbers the worst of :data:`STEP_SPREADS`).

    Raises:
        ReproError: fewer than two earlier runs, or alpha outside (0, 1).
    """
    if len(previous) < 2:
        raise ReproError(f"a seed band needs at least two earlier runs, got {len(previous)}")
    if not 0 < alpha < 1:
        raise ReproError(f"alpha must be in (0, 1), got {alpha}")
    new = _seed_metrics(record)
    old = [_seed_metrics(p) for p in previous]
    steps: dict[str, float] = {}
    for p in previous:
        for name, step in _resolutions(p).items():
            steps[name] = max(step, steps.get(name, 0.0))  # the coarsest grid among the seeds
    names = list(new) + sorted({n for values in old for n in values} - set(new))
    earlier = {name: [values[name] for values in old if values.get(name) is not None] for name in names}
    banded = [name for name in names if len(earlier[name]) >= 2]
    confidence = family_confidence(alpha, max(1, len(banded)))
    source = f"{len(previous)} seeds: " + ", ".join(p.run_id for p in previous)
    rows = []
    for name in names:
        measured = new.get(name)
        common = dict(run_id=record.run_id, metric=name, measured=measured, source=source)
        if name not in banded:
            if measured is not None or earlier[name]:
                rows.append(CheckRow(**common, reference=earlier[name][0] if earlier[name] else None, tolerance="--",
                                     status=SKIPPED, note=f"measured in {len(earlier[name])} earlier run(s); a band needs 2"))
            continue
        step = steps.get(name, 0.0)
        band = prediction_interval(earlier[name], confidence, step)
        spread = max(statistics.stdev(earlier[name]), grid_sd_floor(band.n, step))
        detectable = minimum_detectable_shift(band.n, confidence, DETECTION_POWER) * spread if spread > 0 else None
        tolerance = f"{confidence:.2%} PI [{band.low:.6g}, {band.high:.6g}] (n={band.n})"
        note = f"steps of {step:.3g} (1/{round(1 / step)} questions)" if step else ""
        if measured is None:
            status, note = FAIL, "missing in this run"
        else:
            status = OK if band.contains(measured, atol) else FAIL
        rows.append(CheckRow(**common, reference=band.estimate, tolerance=tolerance, status=status, note=note,
                             detectable=detectable))
    sizes = sorted({len(earlier[name]) for name in banded})
    header = (
        f"Against {len(previous)} seeds: K = {len(banded)} number{'s' if len(banded) != 1 else ''} compared, "
        f"{sum(name in steps for name in banded)} of them in whole questions; each number's prediction interval "
        f"at 1 - {alpha:g}/{len(banded)} = {confidence:.2%} (Bonferroni, family-wise false-alarm rate {alpha:.0%} "
        f"for normal numbers; a stepped number's spread at least its grid's){_validated(banded, earlier, steps, alpha)}. "
        f"'detectable': the smallest shift of a number, in its own units, caught with {DETECTION_POWER:.0%} "
        f"probability at {'/'.join(map(str, sizes)) or 'no'} seeds; smaller real changes pass unseen."
    )
    differ = _setting_differences(record, previous)
    if differ:
        header = f"Settings differ from the seeds' ({differ}): the bands describe other runs.\n{header}"
    return CheckReport(tuple(_noted(row, record, previous) for row in rows), header)


def _setting_differences(record: RunRecord, previous: Sequence[RunRecord]) -> str:
    """``schedule.steps: 200 here, 30 in s1, s2``: settings (seed and name aside) differing from the seeds', or ''."""
    def settings(r: RunRecord) -> dict[str, Any]:
        config = r.experiment.config.get("experiment", r.experiment.config)
        flat = flatten(config) if isinstance(config, dict) else {"": config}
        return {k: v for k, v in flat.items() if k not in ("seed", "name")}

    mine, parts = settings(record), []
    theirs = [(p.run_id, settings(p)) for p in previous]
    for key in sorted(set(mine).union(*(t for _, t in theirs))):
        other = {}
        for run_id, t in theirs:
            if t.get(key) != mine.get(key):
                other.setdefault(repr(t.get(key)), []).append(run_id)
        if other:
            parts.append(f"{key}: {mine.get(key)!r} here, " + "; ".join(f"{v} in {', '.join(ids)}" for v, ids in other.items()))
    return "; ".join(parts)


def _validated(banded: Sequence[str], earlier: dict[str, list[float]], steps: dict[str, float], alpha: float) -> str:
    """``; simulated ...``: the :func:`simulated_false_alarm` rate for these numbers, '' when nothing is banded."""
    if not banded:
        return ""
    n = min(len(earlier[name]) for name in banded)
    resolutions = [steps.get(name, 0.0) for name in banded]
    own = [statistics.stdev(earlier[name][:n]) for name in banded]
    trials = [own] + [[k * r if r else s for s, r in zip(own, resolutions)] for k in STEP_SPREADS if any(resolutions)]
    worst = max(simulated_false_alarm(spreads, resolutions, n, alpha=alpha, seed=i) for i, spreads in enumerate(trials))
    return (f"; simulated for these numbers at {n} seeds: {worst:.3f} (worst over {len(trials)} spread settings, "
            f"{VALIDATION_DRAWS} draws each)")


def _num(value: float | None, signed: bool = False) -> str:
    return "--" if value is None else format(value, "+.6g" if signed else ".6g")


def _detectable(row: CheckRow) -> str:
    """``+-shift (x% of the reference)``, ``--`` where there is none."""
    if row.detectable is None:
        return "--"
    share = f" ({100 * row.detectable / abs(row.reference):.2g}%)" if row.reference else ""
    return f"±{row.detectable:.3g}{share}"


def render_report(report: CheckReport) -> str:
    """The delta table of a check (GitHub Markdown) with a one-line verdict, ending in a newline."""
    powered = any(r.detectable is not None for r in report.rows)
    rows = [
        (r.run_id, r.metric, _num(r.measured), _num(r.reference), _num(r.delta, signed=True), r.tolerance,
         *((_detectable(r),) if powered else ()), r.source, r.status, r.note)
        for r in report.rows
    ]
    headers = ("run", "metric", "measured", "reference", "delta", "tolerance",
               *((f"detectable ({DETECTION_POWER:.0%})",) if powered else ()), "source", "status", "note")
    table = tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)
    if report.header:
        table = f"{report.header}\n\n{table}"
    failed = sum(r.status == FAIL for r in report.rows)
    skipped = sum(r.status == SKIPPED for r in report.rows)
    verdict = "PASS" if report.passed else "FAIL"
    return f"{table}\n\n{verdict}: {report.compared} compared, {failed} outside tolerance, {skipped} skipped\n"
