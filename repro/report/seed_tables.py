"""Comparing routers over seeds (docs/evaluation.md, "Over seeds"): one row per router (runs grouped by
:func:`comparison_label`), each cell ``mean +- half-width of the 95% Student-t interval``, marked where the router
differs from a reference router (:mod:`repro.report.over_seeds`): the zero-shot scores (:func:`compare_over_seeds`)
and any per-run numbers (:func:`compare_metrics_over_seeds`, for :mod:`repro.report.tables`' validation and routing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from repro.errors import ReproError
from repro.records.run_record import PartialTask, RunRecord
from repro.report.compute_parity import DEFAULT_REFERENCE_ROUTER
from repro.report.over_seeds import SeedStat, against_reference, count_defined, marks_sentence
from repro.report.table_core import (
    DENSE_SUFFIX,
    PARTIAL,
    PLUS_MINUS,
    SIGNIFICANT,
    Table,
    _partial_note,
    fmt_interval,
    mean_or_none,
    metric_text,
    record_partial,
    task_label,
    zero_shot_columns,
)
from repro.stats import PairedTest, mcnemar_exact, paired_permutation_test, question_scores

SEED_TESTS = ("auto", "seeds", "questions", "none")
AVG = "avg"


def record_seed(record: RunRecord) -> int:
    """A run's training seed from its config (top level or under ``experiment``); ReproError if none."""
    config = record.experiment.config
    for holder in (config, config.get("experiment")):
        if isinstance(holder, Mapping):
            seed = holder.get("seed")
            if isinstance(seed, int) and not isinstance(seed, bool):
                return seed
    raise ReproError(f"run '{record.run_id}': its config records no seed")


@dataclass(frozen=True)
class SeedComparison:
    """Routers over seeds against a reference router (``test``, ``confidence``, ``alpha``, ``family``:
    :func:`compare_over_seeds`).

    Args:
        columns: task names, then ``avg``.
        metrics: the lm-eval metric of each task column.
        seeds: router -> its seeds, sorted.
        cells: router -> column -> :class:`SeedStat` (routers in table order).
        reference: the reference router (None when absent).
        partial: router -> tasks scored on part of their documents (``run_id -> task -> entry``).
    """

    columns: tuple[str, ...]
    metrics: Mapping[str, str]
    seeds: Mapping[str, tuple[int, ...]]
    cells: Mapping[str, Mapping[str, SeedStat]]
    reference: str | None
    test: str
    confidence: float
    alpha: float
    partial: Mapping[str, Mapping[str, Mapping[str, PartialTask]]] = dataclasses.field(default_factory=dict)
    family: str = "table"

    def is_partial(self, router: str, column: str) -> bool:
        """Whether a run of ``router`` scored ``column`` (any task, for Avg.) on part of its documents."""
        runs = self.partial.get(router, {})
        return any(tasks and (column == AVG or column in tasks) for tasks in runs.values())

    def significant(self, router: str, column: str) -> bool:
        """Whether ``router`` differs from the reference in ``column`` at ``alpha`` (Holm-adjusted)."""
        cell = self.cells.get(router, {}).get(column)  # no cell: the router has no value in the column
        return cell is not None and cell.significant(self.alpha)


def comparison_label(record: RunRecord) -> str:
    """The name a run is compared under: its experiment's name without the model (``dirmoe+centered-tiny`` ->
    ``dirmoe+centered``: variants are not more seeds of their router); else the router's name."""
    name, router = record.experiment.name, record.experiment.router
    for model in (record.experiment.model, record.experiment.model.removesuffix(DENSE_SUFFIX)):
        label = name.removesuffix(f"-{model}")
        if label != name and label.partition("+")[0] == router:
            return label
    return router


def _group_by_router(
    records: Sequence[RunRecord], reference_router: str
) -> tuple[dict[str, dict[int, RunRecord]], str | None, bool]:
    """``{comparison label: {seed: record}}`` in table order; the reference (None if absent); whether every other
    router shares two seeds with it."""
    # A dense baseline runs the model's dense counterpart (flavour ``<model>-dense``): the same model.
    models = sorted({r.experiment.model.removesuffix(DENSE_SUFFIX) for r in records})
    if len(models) > 1:
        raise ReproError(f"runs of several models ({', '.join(models)}): compare one model's runs at a time")
    groups: dict[str, dict[int, RunRecord]] = {}
    for record in sorted(records, key=lambda r: (r.experiment.router != "dense", comparison_label(r), r.run_id)):
        seed, label = record_seed(record), comparison_label(record)
        runs = groups.setdefault(label, {})
        if seed in runs:
            raise ReproError(f"runs '{runs[seed].run_id}' and '{record.run_id}' of '{label}' have the same seed {seed}")
        runs[seed] = record
    reference = reference_router if reference_router in groups else None
    others = [r for r in groups if r != reference]
    # Nothing to test without another row: the caption must not claim a test.
    seeds_ok = reference is not None and bool(others) and all(
        len(set(groups[r]) & set(groups[reference])) >= 2 for r in others
    )
    return groups, reference, seeds_ok


def _question_test(
    tasks: Sequence[str], metrics: Mapping[str, str], reference: Mapping[int, RunRecord],
    other: Mapping[int, RunRecord], per_question: Mapping[str, Mapping[str, Any]],
) -> PairedTest:
    """Per-question test of ``other`` against ``reference`` on ``tasks`` (one task, or all for Avg.)."""
    ref_scores, oth_scores, weights = [], [], []
    for task in tasks:
        per_run = [[question_scores(per_question[r.run_id], task, metrics[task]) for r in runs.values()]
                   for runs in (reference, other)]
        if any(q is None for runs in per_run for q in runs):
            raise ReproError(f"task '{task}': a run has no per-question '{metrics[task]}' results")
        first = per_run[0][0]
        if not all(first.paired_with(q) for runs in per_run for q in runs):
            raise ReproError(f"task '{task}': the runs scored different questions; they cannot be paired")
        # Several seeds: a question's score is its correctness averaged over the router's seeds.
        ref_scores.append(np.mean([q.scores for q in per_run[0]], axis=0))
        oth_scores.append(np.mean([q.scores for q in per_run[1]], axis=0))
        weights.append(np.full(len(first.scores), 1 / (len(tasks) * len(first.scores))))
    ref, oth = np.concatenate(ref_scores), np.concatenate(oth_scores)
    if len(tasks) == 1 and len(reference) == 1 and len(other) == 1:
        test = mcnemar_exact(ref, oth)
    else:
        test = paired_permutation_test(ref, oth, weights=np.concatenate(weights))
    return PairedTest(test.test, 100 * test.difference, test.statistic, test.p_value, test.n)


def compare_over_seeds(
    records: Sequence[RunRecord], *, reference_router: str = DEFAULT_REFERENCE_ROUTER, metric: str = "auto",
    per_question: Mapping[str, Mapping[str, Any]] | None = None, test: str = "auto", confidence: float = 0.95,
    alpha: float = 0.05, family: str = "table",
) -> SeedComparison:
    """Each router's zero-shot scores over its seeds, tested against a reference router.

    Args:
        records: runs of one model, one per router and seed (runs without lm-eval results left out).
        reference_router: the router the others are tested against.
        metric: ``auto``, ``acc`` or ``acc_norm`` (:func:`choose_metric`).
        per_question: run_id -> per-question results (:func:`repro.stats.compact_per_question`), for
            ``test="questions"``; default: the records' ``per_question`` fields, where all have one.
        test: ``seeds`` (paired t over shared seeds), ``questions`` (McNemar's exact test with one seed per
            router, else a sign-flip permutation test over questions of seed-averaged correctness), ``none``, or
            ``auto``: ``seeds`` when every router shares >= 2 seeds with the reference, else ``questions`` when
            every run has per-question results, else ``none``.
        confidence: Student-t interval coverage.
        alpha: significance level of the marks (Holm-adjusted over ``family``).
        family: Holm family, ``table`` or ``column`` (:mod:`repro.report.over_seeds`).

    Raises:
        ReproError: several models, one router's seed twice, an unknown test, or a test the records cannot support.
    """
    if test not in SEED_TESTS:
        raise ReproError(f"unknown test '{test}'; valid: {', '.join(SEED_TESTS)}")
    evaluated = [r for r in records if r.lm_eval is not None]
    groups, reference, seeds_ok = _group_by_router(evaluated, reference_router)
    if per_question is None and evaluated and all(r.per_question is not None for r in evaluated):
        per_question = {r.run_id: r.per_question for r in evaluated}
    scores, chosen = zero_shot_columns(evaluated, metric)
    tasks = list(chosen)

    def value(record: RunRecord, column: str) -> float | None:
        if column == AVG:
            return mean_or_none([value(record, t) for t in tasks])
        v = scores[record.run_id].get(column, {}).get(chosen[column])
        return None if v is None else 100 * v

    columns = (*tasks, AVG)
    questions_ok = (
        reference is not None and len(groups) > 1 and per_question is not None
        and all(r.run_id in per_question for r in evaluated)
    )
    used = ("seeds" if seeds_ok else "questions" if questions_ok else "none") if test == "auto" else test
    if test == "seeds" and not seeds_ok:
        raise ReproError(f"test 'seeds' needs the reference '{reference_router}' and two shared seeds per router")
    elif test == "questions" and not questions_ok:
        raise ReproError(f"test 'questions' needs the reference '{reference_router}' and per-question results of every run")

    def question_test(router: str, _reference: str, column: str) -> PairedTest:
        return _question_test(
            tasks if column == AVG else [column], chosen, groups[reference], groups[router], per_question
        )

    cut = {router: {r.run_id: {t: p for t, p in record_partial(r).items() if t in chosen} for r in runs.values()}
           for router, runs in groups.items()}
    partial = {router: {run: ts for run, ts in c.items() if ts} for router, c in cut.items() if any(c.values())}
    return _compared(groups, reference, columns, value, used, confidence=confidence, alpha=alpha, family=family,
                     question_test=question_test, metrics=chosen, partial=partial)


def _compared(
    groups: Mapping[str, Mapping[int, RunRecord]], reference: str | None, columns: Sequence[str],
    value: Callable[[RunRecord, str], float | None], test: str, *, confidence: float, alpha: float, family: str,
    question_test: Callable[[str, str, str], PairedTest] | None = None, **fields: Any,
) -> SeedComparison:
    """The :class:`SeedComparison` of ``groups`` (router -> seed -> run) in ``columns`` (``value``: a run's number
    or None) by ``test`` (``questions``: ``question_test``); ``fields``: the comparison's other fields."""
    values = {
        router: {c: {seed: v for seed, record in sorted(runs.items()) if (v := value(record, c)) is not None}
                 for c in columns}
        for router, runs in groups.items()
    }
    cells = against_reference(values, columns, reference, family=family, confidence=confidence, tested=test != "none",
                              test=question_test if test == "questions" else None)
    return SeedComparison(
        columns=tuple(columns), seeds={r: tuple(sorted(runs)) for r, runs in groups.items()}, cells=cells,
        reference=reference, test=test, confidence=confidence, alpha=alpha, family=family, **fields,
    )


_TEST_TEXT = {
    "seeds": "a paired t-test over the seeds both routers ran",
    "questions": (
        "a paired test over the same questions (McNemar's exact test with one seed per router; otherwise a "
        "sign-flip permutation test of the correctness averaged over seeds; for Avg. of the task-weighted mean)"
    ),
}


def _rows_over_seeds(
    comparison: SeedComparison, specs: Mapping[str, str] | None = None, default: str = ".2f"
) -> tuple[tuple[str, ...], ...]:
    """A row per router (reference, dense, then by name): label, seeds, marked ``mean +- half-width`` per column."""
    ordered = sorted(comparison.cells.items(), key=lambda item: item[0] != comparison.reference)
    rows = []
    for router, cells in ordered:
        label = f"{router} (reference)" if router == comparison.reference else router
        row = [label, str(len(comparison.seeds[router]))]
        for column in comparison.columns:
            mark = SIGNIFICANT if comparison.significant(router, column) else ""
            mark += PARTIAL if comparison.is_partial(router, column) else ""
            row.append(fmt_interval(cells[column].interval, (specs or {}).get(column, default), mark))
        rows.append(tuple(row))
    return tuple(rows)


def _caption(comparison: SeedComparison, what: str, labels: Mapping[str, str], untested: str) -> str:
    """Caption: ``what``, what a cell is, and the test behind the marks (``untested``: why there is none)."""
    caption = (
        f"{what} Each cell: the mean over the router's seeds {PLUS_MINUS} the half-width of the "
        f"{comparison.confidence:.0%} Student-t confidence interval of that mean (no {PLUS_MINUS} with one seed); "
        "'seeds' is their number."
    )
    if comparison.test not in _TEST_TEXT or comparison.reference is None:
        return caption + f" No significance test (no reference router, or {untested})."
    return f"{caption} " + marks_sentence(comparison.reference, comparison.alpha, _TEST_TEXT[comparison.test],
                                          comparison.family, comparison.cells, "routers", labels)


def zero_shot_headers(comparison: SeedComparison) -> dict[str, str]:
    """Column -> its header in the ``zero_shot_seeds`` table (a task's label, ``Avg.``)."""
    return {c: "Avg." if c == AVG else task_label(c) for c in comparison.columns}


def comparison_json(comparison: SeedComparison, headers: Mapping[str, str]) -> dict[str, Any]:
    """A comparison over seeds as ``summary.json`` holds it for the write-ups: the reference, the Holm family and
    its defined tests, and per router and column header the mean, half-width, Holm-adjusted p and mark."""
    def cell(router: str, column: str, stat: SeedStat) -> dict[str, Any]:
        interval = stat.interval
        return {"mean": None if interval is None else interval.estimate,
                "half_width": None if interval is None else interval.half_width,
                "p_holm": stat.adjusted_p, "marked": comparison.significant(router, column)}

    return {"reference": comparison.reference, "family": comparison.family, "tests": count_defined(comparison.cells),
            "cells": {router: {headers.get(c, c): cell(router, c, s) for c, s in cells.items()}
                      for router, cells in comparison.cells.items()}}


def seed_zero_shot_table(comparison: SeedComparison) -> Table:
    """The ``zero_shot_seeds`` table of a :func:`compare_over_seeds` comparison."""
    headers = zero_shot_headers(comparison)
    what = (
        f"Zero-shot accuracy (%) over seeds, lm-eval, 0-shot. Metric per column: {metric_text(comparison.metrics)}. "
        "Avg. is the mean over the task columns, per seed."
    )
    caption = _caption(comparison, what, headers, "neither shared seeds nor per-question results")
    caption += _partial_note({run: tasks for runs in comparison.partial.values() for run, tasks in runs.items()})
    return Table("zero_shot_seeds", caption, ("Router", "seeds", *headers.values()), _rows_over_seeds(comparison))


# ------------------------------------------------------------------------------------------ other numbers over seeds
def compare_metrics_over_seeds(
    records: Sequence[RunRecord], columns: Mapping[str, Callable[[RunRecord], float | None]], *,
    reference_router: str = DEFAULT_REFERENCE_ROUTER, confidence: float = 0.95, alpha: float = 0.05,
    family: str = "table",
) -> SeedComparison:
    """Per-run numbers (losses, routing statistics) over seeds, tested against a reference router by a paired
    t-test over shared seeds where every other router shares at least two (``test``: ``seeds``, else ``none``).

    ``columns``: column name -> the run's number (None: none; runs with none left out); other arguments as
    :func:`compare_over_seeds`. ReproError: several models, or one router's seed twice.
    """
    measured = [r for r in records if any(f(r) is not None for f in columns.values())]
    groups, reference, seeds_ok = _group_by_router(measured, reference_router)
    return _compared(groups, reference, tuple(columns), lambda record, column: columns[column](record),
                     "seeds" if seeds_ok else "none", confidence=confidence, alpha=alpha, family=family,
                     metrics={c: c for c in columns})


def seed_metric_table(
    comparison: SeedComparison, *, name: str, what: str, labels: Mapping[str, str],
    specs: Mapping[str, str] | None = None,
) -> Table:
    """A table over seeds of per-run numbers (:func:`compare_metrics_over_seeds`), marked like the zero-shot one;
    ``what``: the caption's first sentence; ``labels``/``specs``: column headers and formats (default: name, .3f)."""
    caption = _caption(comparison, what, labels, "fewer than two seeds shared with it")
    headers = ("Router", "seeds", *(labels.get(c, c) for c in comparison.columns))
    return Table(name, caption, headers, _rows_over_seeds(comparison, specs, default=".3f"))
