"""The paper's tables, generated from run records (never edited by hand).

Three tables, each a :class:`Table` rendered as Markdown, CSV or LaTeX (:func:`render`):

- :func:`zero_shot_table`: rows = runs, columns = ARC-c, ARC-e, BoolQ, HellaSwag, LAMBADA, PIQA, RACE (the
  ones any row has), then the local tasks of the embedded default, then Avg.; each cell ``value +- lm-eval's
  standard error``;
- :func:`seed_zero_shot_table`: the same columns, one row per router over its runs with different seeds:
  ``mean +- half-width of the 95% Student-t interval``, marked where the router differs from a reference
  router (paired over seeds or over questions, :mod:`repro.report.stats`);
- :func:`efficiency_table`: ms/iter, TFLOP/s per device (analytic and measured), tokens/s, peak memory,
  active experts and the compute-parity verdict;
- :func:`routing_table`: active experts per token, Simpson index, load imbalance and dropped mass, per layer;
- :func:`validation_table`: the final validation loss and the held-out loss per domain, per run;
- over seeds, with the same marks as :func:`seed_zero_shot_table`: :func:`validation_seed_table` and
  :func:`routing_seed_table` (:func:`compare_metrics_over_seeds` for any per-run numbers).

A zero-shot cell of a task scored on part of its documents (``python -m repro eval --limit``, the record's
``partial`` tasks) carries a dagger, and the caption says how many documents were scored.

With published numbers (a ledger, :mod:`repro.report.ledger`), each run is followed by the published rows of
its router measured in the same model setting, and a ``delta`` row (measured minus published).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tabulate import tabulate

from repro.errors import ReproError
from repro.evaluation.local_tasks import LOCAL_TASK_LABELS
from repro.io_utils import atomic_path
from repro.report.ledger import PublishedEntry, select
from repro.report.parity import DEFAULT_PARITY_TOLERANCE, DEFAULT_REFERENCE_ROUTER, compute_parity
from repro.report.record import PartialTask, RunRecord, lm_eval_metrics, partial_tasks
from repro.report.stats import (
    Interval,
    PairedTest,
    holm,
    mcnemar_exact,
    mean_ci,
    paired_permutation_test,
    paired_t_test,
    question_scores,
)

#: The papers' zero-shot tasks (lm-eval names) and their column labels, in the papers' order.
PAPER_TASKS: dict[str, str] = {
    "arc_challenge": "ARC-c",
    "arc_easy": "ARC-e",
    "boolq": "BoolQ",
    "hellaswag": "HellaSwag",
    "lambada_openai": "LAMBADA",
    "piqa": "PIQA",
    "race": "RACE",
}
ZERO_SHOT_METRICS = ("auto", "acc", "acc_norm")
FORMATS = ("md", "csv", "tex")
MISSING = "--"
PLUS_MINUS = "±"
SIGNIFICANT = "*"
#: Marks a zero-shot cell scored on part of the task's documents (lm-eval's ``limit``).
PARTIAL = "†"
SEED_TESTS = ("auto", "seeds", "questions", "none")
#: The suffix of a model's dense counterpart (``tiny-dense``, ``llama-185m-dense``: repro.model.flavours).
DENSE_SUFFIX = "-dense"


@dataclass(frozen=True)
class Table:
    """A generated table.

    Args:
        name: file stem (``zero_shot``).
        caption: what the numbers are and how they were chosen.
        headers: column labels.
        rows: cells, already formatted as text.
    """

    name: str
    caption: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return MISSING
    text = format(value, spec)
    return format(0.0, spec) if float(text) == 0 else text  # no "-0.00" from rounding


def _fmt_tflops(value: float | None) -> str:
    """Two decimals as the papers print them; three significant digits for the tiny CPU figures."""
    return _fmt(value, ".2f" if value is None or value >= 1 else ".3g")


def _fmt_pm(value: float | None, error: float | None, mark: str = "", spec: str = ".2f") -> str:
    """``value +- error`` (``value`` alone where there is no error), then ``mark``."""
    if value is None:
        return MISSING
    text = _fmt(value, spec) if error is None else f"{_fmt(value, spec)} {PLUS_MINUS} {_fmt(error, spec)}"
    return text + mark


def record_partial(record: RunRecord) -> dict[str, PartialTask]:
    """The tasks a run scored on part of their documents: its ``partial`` field, and for records written
    before that field, what lm-eval's own ``n-samples`` / ``config.limit`` say.

    Args:
        record: a run record.

    Returns:
        task -> :class:`~repro.report.record.PartialTask`.
    """
    found = {p.task: p for p in partial_tasks(record.lm_eval)}
    found.update({p.task: p for p in record.partial})
    return found


def _partial_note(partial: Mapping[str, Mapping[str, PartialTask]]) -> str:
    """The caption sentence for the dagger: each partial run and task, runs cut alike named together ('' when
    there is none)."""
    runs_by_cut: dict[str, list[str]] = {}
    for label, tasks in partial.items():
        if tasks:
            runs_by_cut.setdefault("; ".join(tasks[t].describe() for t in sorted(tasks)), []).append(label)
    if not runs_by_cut:
        return ""
    listed = "; ".join(f"{', '.join(labels)} ({cut})" for cut, labels in runs_by_cut.items())
    return (
        f" {PARTIAL}: scored on part of the task's documents (lm-eval's limit, `eval --limit`), not comparable "
        f"with complete runs: {listed}."
    )


def lm_eval_stderr(record: RunRecord, task: str, metric: str) -> float | None:
    """lm-eval's standard error of a task's metric (``<metric>_stderr,none``) as a fraction.

    Args:
        record: a run record.
        task: lm-eval task name.
        metric: ``acc``, ``acc_norm``, ...

    Returns:
        The standard error, None where the run has none (not evaluated, or ``bootstrap_iters=0``: "N/A").
    """
    if record.lm_eval is None:
        return None
    value = record.lm_eval["results"].get(task, {}).get(f"{metric}_stderr,none")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ordered(records: Sequence[RunRecord]) -> list[RunRecord]:
    """The dense baseline first, then routers by name, then run_id: tables do not depend on file names or
    argument order, and no router is placed by name."""
    return sorted(records, key=lambda r: (r.experiment.router != "dense", r.experiment.router, r.run_id))


def _labels(records: Sequence[RunRecord]) -> dict[str, str]:
    """Row label per run: the router, or ``router (run_id)`` where a router has several runs (a run whose id is
    the router's name keeps the plain name; a variant such as ``dirmoe+centered`` is named by its id)."""
    routers = [r.experiment.router for r in records]

    def label(r: RunRecord) -> str:
        router = r.experiment.router
        return router if routers.count(router) == 1 or r.run_id == router else f"{router} ({r.run_id})"

    return {r.run_id: label(r) for r in records}


def _published_groups(
    record: RunRecord, ledger: Sequence[PublishedEntry], prefix: str
) -> dict[str, dict[str, PublishedEntry]]:
    """Original published entries for this run's router and model, ``source -> metric -> entry``."""
    groups: dict[str, dict[str, PublishedEntry]] = {}
    for e in select(ledger, router=record.experiment.router, model_id=record.experiment.model, originals_only=True):
        if e.metric.startswith(prefix):
            groups.setdefault(e.source, {})[e.metric] = e
    return groups


# ------------------------------------------------------------------------------------------ zero-shot
def choose_metric(task: str, records: Sequence[RunRecord], metric: str = "auto") -> str:
    """The lm-eval metric shown for ``task``.

    Args:
        task: lm-eval task name.
        records: the runs in the table.
        metric: ``acc``, ``acc_norm`` or ``auto`` (acc_norm where every run reports it for the task, else acc).

    Returns:
        ``"acc"`` or ``"acc_norm"``.
    """
    if metric not in ZERO_SHOT_METRICS:
        raise ReproError(f"unknown zero-shot metric '{metric}'; valid: {', '.join(ZERO_SHOT_METRICS)}")
    if metric != "auto":
        return metric
    reported = [m[task] for m in map(lm_eval_metrics, records) if task in m]
    return "acc_norm" if reported and all("acc_norm" in m for m in reported) else "acc"


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


# ------------------------------------------------------------------------------------------ over seeds
def record_seed(record: RunRecord) -> int:
    """A run's training seed, from its config (``seed`` at the top level or under ``experiment``).

    Args:
        record: a run record.

    Returns:
        The seed.

    Raises:
        ReproError: the config records no integer seed.
    """
    config = record.experiment.config
    for holder in (config, config.get("experiment")):
        if isinstance(holder, Mapping):
            seed = holder.get("seed")
            if isinstance(seed, int) and not isinstance(seed, bool):
                return seed
    raise ReproError(f"run '{record.run_id}': its config records no seed")


@dataclass(frozen=True)
class SeedCell:
    """One router's result in one column over its seeds.

    Args:
        interval: mean and Student-t interval over the seeds (percent).
        test: the paired test against the reference router (None: the reference itself, or no test).
        adjusted_p: the test's p-value after Holm's adjustment over the routers of the column.
    """

    interval: Interval
    test: PairedTest | None = None
    adjusted_p: float | None = None


@dataclass(frozen=True)
class SeedComparison:
    """Routers over seeds against a reference router (see :func:`compare_over_seeds`).

    Args:
        columns: task names, then ``avg``.
        metrics: the lm-eval metric of each task column.
        seeds: router -> its seeds, sorted.
        cells: router -> column -> :class:`SeedCell` (routers in table order).
        reference: the reference router (None when it is not among the records).
        test: the test used: ``seeds`` (paired t over shared seeds), ``questions`` (McNemar exact /
            sign-flip permutation over shared questions) or ``none``.
        confidence: coverage of the intervals.
        alpha: significance level of the marks.
        partial: router -> its runs' tasks scored on part of their documents (``run_id -> task -> entry``).
    """

    columns: tuple[str, ...]
    metrics: Mapping[str, str]
    seeds: Mapping[str, tuple[int, ...]]
    cells: Mapping[str, Mapping[str, SeedCell]]
    reference: str | None
    test: str
    confidence: float
    alpha: float
    partial: Mapping[str, Mapping[str, Mapping[str, PartialTask]]] = dataclasses.field(default_factory=dict)

    def is_partial(self, router: str, column: str) -> bool:
        """Whether a run of ``router`` scored ``column`` (any task, for Avg.) on part of its documents."""
        runs = self.partial.get(router, {})
        return any(tasks and (column == AVG or column in tasks) for tasks in runs.values())

    def significant(self, router: str, column: str) -> bool:
        """Whether ``router`` differs from the reference in ``column`` at ``alpha`` (Holm-adjusted)."""
        cell = self.cells.get(router, {}).get(column)  # no cell: the router has no value in the column
        return cell is not None and cell.adjusted_p is not None and cell.adjusted_p < self.alpha


AVG = "avg"


def comparison_label(record: RunRecord) -> str:
    """The name a run is compared under over seeds: its experiment's name without the model
    (``dirmoe+centered-tiny`` -> ``dirmoe+centered``), so a router's variants are compared beside the router
    instead of being taken for more seeds of it; the router's name where the experiment is named otherwise.

    Args:
        record: a run record.

    Returns:
        The label (``switch``, ``dense``, ``dirmoe+centered``, ...).
    """
    name, router = record.experiment.name, record.experiment.router
    for model in (record.experiment.model, record.experiment.model.removesuffix(DENSE_SUFFIX)):
        label = name.removesuffix(f"-{model}")
        if label != name and label.partition("+")[0] == router:
            return label
    return router


def _group_by_router(
    records: Sequence[RunRecord], seed_of: Callable[[RunRecord], int]
) -> dict[str, dict[int, RunRecord]]:
    """``{comparison label: {seed: record}}`` (see :func:`comparison_label`), labels in table order."""
    # A dense baseline runs the model's dense counterpart (flavour ``<model>-dense``): the same model.
    models = sorted({r.experiment.model.removesuffix(DENSE_SUFFIX) for r in records})
    if len(models) > 1:
        raise ReproError(f"runs of several models ({', '.join(models)}): compare one model's runs at a time")
    groups: dict[str, dict[int, RunRecord]] = {}
    for record in sorted(records, key=lambda r: (r.experiment.router != "dense", comparison_label(r), r.run_id)):
        seed, label = seed_of(record), comparison_label(record)
        runs = groups.setdefault(label, {})
        if seed in runs:
            raise ReproError(
                f"runs '{runs[seed].run_id}' and '{record.run_id}' of '{label}' have the same seed {seed}"
            )
        runs[seed] = record
    return groups


def _question_test(
    tasks: Sequence[str],
    metrics: Mapping[str, str],
    reference: Mapping[int, RunRecord],
    other: Mapping[int, RunRecord],
    per_question: Mapping[str, Mapping[str, Any]],
) -> PairedTest:
    """Per-question test of ``other`` against ``reference`` on ``tasks`` (one task, or all for Avg.)."""
    ref_scores, oth_scores, weights = [], [], []
    for task in tasks:
        per_run = []
        for runs in (reference, other):
            found = [question_scores(per_question[r.run_id], task, metrics[task]) for r in runs.values()]
            if any(q is None for q in found):
                raise ReproError(f"task '{task}': a run has no per-question '{metrics[task]}' results")
            per_run.append(found)
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
    records: Sequence[RunRecord],
    *,
    reference_router: str = DEFAULT_REFERENCE_ROUTER,
    metric: str = "auto",
    per_question: Mapping[str, Mapping[str, Any]] | None = None,
    test: str = "auto",
    confidence: float = 0.95,
    alpha: float = 0.05,
    seed_of: Callable[[RunRecord], int] = record_seed,
) -> SeedComparison:
    """Each router's zero-shot scores over its seeds, tested against a reference router.

    Args:
        records: runs of one model with lm-eval results, one per router and seed (runs without results are
            left out).
        reference_router: the router the others are tested against.
        metric: ``auto``, ``acc`` or ``acc_norm`` (see :func:`choose_metric`).
        per_question: run_id -> the run's per-question results
            (:func:`repro.report.stats.compact_per_question`); needed for ``test="questions"``. Default: the
            records' own ``per_question`` fields, where every evaluated record has one.
        test: ``seeds`` (paired t over the seeds both routers ran), ``questions`` (McNemar's exact test with
            one seed per router, else a sign-flip permutation test over questions of the correctness averaged
            over seeds), ``none``, or ``auto``: ``seeds`` when every router shares at least two seeds with the
            reference, else ``questions`` when every run has per-question results, else ``none``.
        confidence: coverage of the Student-t intervals.
        alpha: significance level of the marks (after Holm's adjustment over the routers of a column).
        seed_of: a run's seed (default :func:`record_seed`).

    Returns:
        The :class:`SeedComparison`.

    Raises:
        ReproError: runs of several models, two runs of one router with the same seed, an unknown test, or a
            test the records cannot support.
    """
    if test not in SEED_TESTS:
        raise ReproError(f"unknown test '{test}'; valid: {', '.join(SEED_TESTS)}")
    evaluated = [r for r in records if r.lm_eval is not None]
    groups = _group_by_router(evaluated, seed_of)
    if per_question is None and evaluated and all(r.per_question is not None for r in evaluated):
        per_question = {r.run_id: r.per_question for r in evaluated}
    scores = {r.run_id: lm_eval_metrics(r) for r in evaluated}
    measured = {t for s in scores.values() for t, m in s.items() if "acc" in m or "acc_norm" in m}
    tasks = [t for t in PAPER_TASKS if t in measured] + sorted(measured - set(PAPER_TASKS))
    chosen = {t: choose_metric(t, evaluated, metric) for t in tasks}

    def value(record: RunRecord, column: str) -> float | None:
        if column == AVG:
            values = [value(record, t) for t in tasks]
            return statistics.fmean(values) if values and None not in values else None
        v = scores[record.run_id].get(column, {}).get(chosen[column])
        return None if v is None else 100 * v

    columns = (*tasks, AVG)
    reference = reference_router if reference_router in groups else None
    others = [r for r in groups if r != reference]
    shared = {r: sorted(set(groups[r]) & set(groups[reference])) for r in others} if reference else {}
    seeds_ok = reference is not None and all(len(shared[r]) >= 2 for r in others)
    questions_ok = (
        reference is not None and per_question is not None and all(r.run_id in per_question for r in evaluated)
    )
    used = test
    if test == "auto":
        used = "seeds" if seeds_ok else "questions" if questions_ok else "none"
    elif test == "seeds" and not seeds_ok:
        raise ReproError(f"test 'seeds' needs the reference '{reference_router}' and two shared seeds per router")
    elif test == "questions" and not questions_ok:
        raise ReproError(f"test 'questions' needs the reference '{reference_router}' and per-question results of every run")

    def question_test(router: str, column: str) -> PairedTest:
        return _question_test(
            tasks if column == AVG else [column], chosen, groups[reference], groups[router], per_question
        )

    cells = _cells_over_seeds(
        groups, columns, value, reference, None if used == "none" else question_test if used == "questions" else "seeds",
        confidence,
    )
    partial = {
        router: {r.run_id: {t: p for t, p in record_partial(r).items() if t in chosen} for r in runs.values()}
        for router, runs in groups.items()
    }
    partial = {router: {run: tasks for run, tasks in runs.items() if tasks} for router, runs in partial.items()}
    return SeedComparison(
        columns=columns,
        metrics=chosen,
        seeds={r: tuple(sorted(runs)) for r, runs in groups.items()},
        cells=cells,
        reference=reference,
        test=used,
        confidence=confidence,
        alpha=alpha,
        partial={r: runs for r, runs in partial.items() if runs},
    )


def _cells_over_seeds(
    groups: Mapping[str, Mapping[int, RunRecord]],
    columns: Sequence[str],
    value: Callable[[RunRecord, str], float | None],
    reference: str | None,
    test: Callable[[str, str], PairedTest] | str | None,
    confidence: float,
) -> dict[str, dict[str, SeedCell]]:
    """Each router's interval per column, and its test against ``reference``, Holm-adjusted per column.

    ``test`` is ``"seeds"`` (paired t over the seeds both ran, pairs where both have a value; fewer than two:
    no test), a function ``(router, column) -> PairedTest``, or None (no test).
    """
    others = [r for r in groups if r != reference] if reference is not None else []
    cells: dict[str, dict[str, SeedCell]] = {r: {} for r in groups}
    for column in columns:
        tests: dict[str, PairedTest] = {}
        for router in others if test is not None else ():
            if test == "seeds":
                shared = sorted(set(groups[router]) & set(groups[reference]))
                pairs = [(value(groups[reference][s], column), value(groups[router][s], column)) for s in shared]
                pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
                if len(pairs) >= 2:
                    tests[router] = paired_t_test([a for a, _ in pairs], [b for _, b in pairs])
            else:
                tests[router] = test(router, column)
        adjusted = dict(zip(tests, holm([t.p_value for t in tests.values()]))) if tests else {}
        for router, runs in groups.items():
            values = [v for v in (value(r, column) for r in runs.values()) if v is not None]
            if values:
                cells[router][column] = SeedCell(mean_ci(values, confidence), tests.get(router), adjusted.get(router))
    return cells


_TEST_TEXT = {
    "seeds": "a paired t-test over the seeds both routers ran",
    "questions": (
        "a paired test over the same questions (McNemar's exact test with one seed per router; otherwise a "
        "sign-flip permutation test of the correctness averaged over seeds; for Avg. of the task-weighted mean)"
    ),
}


def seed_zero_shot_table(comparison: SeedComparison) -> Table:
    """The zero-shot table over seeds: ``mean +- CI half-width`` per router, marked where it differs.

    Args:
        comparison: from :func:`compare_over_seeds`.

    Returns:
        The :class:`Table` (name ``zero_shot_seeds``).
    """
    rows = []
    # The reference first, then the routers in the tables' order (dense first, then by name).
    ordered = sorted(comparison.cells.items(), key=lambda item: item[0] != comparison.reference)
    for router, cells in ordered:
        label = f"{router} (reference)" if router == comparison.reference else router
        row = [label, str(len(comparison.seeds[router]))]
        for column in comparison.columns:
            cell = cells.get(column)
            mark = SIGNIFICANT if comparison.significant(router, column) else ""
            mark += PARTIAL if comparison.is_partial(router, column) else ""
            row.append(MISSING if cell is None else _fmt_pm(cell.interval.estimate, cell.interval.half_width, mark))
        rows.append(tuple(row))
    tasks = [c for c in comparison.columns if c != AVG]
    labels = [PAPER_TASKS.get(t) or LOCAL_TASK_LABELS.get(t, t) for t in tasks]
    metric_text = ", ".join(f"{label} {comparison.metrics[t]}" for label, t in zip(labels, tasks))
    caption = (
        f"Zero-shot accuracy (%) over seeds, lm-eval, 0-shot. Metric per column: {metric_text or 'none'}. "
        f"Avg. is the mean over the task columns, per seed. Each cell: the mean over the router's seeds "
        f"{PLUS_MINUS} the half-width of the {comparison.confidence:.0%} Student-t confidence interval of that "
        f"mean (no {PLUS_MINUS} with one seed); 'seeds' is their number."
    )
    if comparison.test in _TEST_TEXT and comparison.reference is not None:
        caption += (
            f" {SIGNIFICANT}: differs from '{comparison.reference}' at alpha = {comparison.alpha:g} by "
            f"{_TEST_TEXT[comparison.test]}, Holm-adjusted over the routers of the column."
        )
    else:
        caption += " No significance test (no reference router, or neither shared seeds nor per-question results)."
    caption += _partial_note({run: tasks for runs in comparison.partial.values() for run, tasks in runs.items()})
    headers = ("Router", "seeds", *labels, "Avg.")
    return Table("zero_shot_seeds", caption, headers, tuple(rows))


# ------------------------------------------------------------------------------------------ other numbers over seeds
def compare_metrics_over_seeds(
    records: Sequence[RunRecord],
    columns: Mapping[str, Callable[[RunRecord], float | None]],
    *,
    reference_router: str = DEFAULT_REFERENCE_ROUTER,
    confidence: float = 0.95,
    alpha: float = 0.05,
    seed_of: Callable[[RunRecord], int] = record_seed,
) -> SeedComparison:
    """Per-run numbers (losses, routing statistics) over seeds, tested against a reference router.

    Each cell is the mean over a router's seeds with its Student-t interval; where every other router shares at
    least two seeds with the reference, a paired t-test over the shared seeds (same seed: same data order and
    initialisation stream), Holm-adjusted over the routers of the column.

    Args:
        records: runs of one model, one per router and seed; a run without any of the numbers is left out.
        columns: column name -> the run's number (None where it has none).
        reference_router: the router the others are tested against.
        confidence: coverage of the intervals.
        alpha: significance level of the marks.
        seed_of: a run's seed (default :func:`record_seed`).

    Returns:
        The :class:`SeedComparison` (``metrics`` maps each column to itself; ``test`` is ``seeds`` or ``none``).

    Raises:
        ReproError: runs of several models, or two runs of one router with the same seed.
    """
    measured = [r for r in records if any(f(r) is not None for f in columns.values())]
    groups = _group_by_router(measured, seed_of)
    reference = reference_router if reference_router in groups else None
    others = [r for r in groups if r != reference]
    seeds_ok = reference is not None and bool(others) and all(
        len(set(groups[r]) & set(groups[reference])) >= 2 for r in others
    )
    cells = _cells_over_seeds(
        groups, tuple(columns), lambda record, column: columns[column](record), reference,
        "seeds" if seeds_ok else None, confidence,
    )
    return SeedComparison(
        columns=tuple(columns),
        metrics={c: c for c in columns},
        seeds={r: tuple(sorted(runs)) for r, runs in groups.items()},
        cells=cells,
        reference=reference,
        test="seeds" if seeds_ok else "none",
        confidence=confidence,
        alpha=alpha,
    )


def seed_metric_table(
    comparison: SeedComparison,
    *,
    name: str,
    what: str,
    labels: Mapping[str, str],
    specs: Mapping[str, str] | None = None,
) -> Table:
    """A table over seeds of per-run numbers (:func:`compare_metrics_over_seeds`), marked like the zero-shot one.

    Args:
        comparison: the comparison.
        name: file stem.
        what: the caption's first sentence (what the numbers are).
        labels: column -> header (default: the column's name).
        specs: column -> number format (default ``.3f``).

    Returns:
        The :class:`Table`.
    """
    rows = []
    ordered = sorted(comparison.cells.items(), key=lambda item: item[0] != comparison.reference)
    for router, cells in ordered:
        label = f"{router} (reference)" if router == comparison.reference else router
        row = [label, str(len(comparison.seeds[router]))]
        for column in comparison.columns:
            cell = cells.get(column)
            mark = SIGNIFICANT if comparison.significant(router, column) else ""
            spec = (specs or {}).get(column, ".3f")
            row.append(MISSING if cell is None else _fmt_pm(cell.interval.estimate, cell.interval.half_width, mark, spec))
        rows.append(tuple(row))
    caption = (
        f"{what} Each cell: the mean over the router's seeds {PLUS_MINUS} the half-width of the "
        f"{comparison.confidence:.0%} Student-t confidence interval of that mean (no {PLUS_MINUS} with one seed); "
        "'seeds' is their number."
    )
    if comparison.test == "seeds" and comparison.reference is not None:
        caption += (
            f" {SIGNIFICANT}: differs from '{comparison.reference}' at alpha = {comparison.alpha:g} by "
            f"{_TEST_TEXT['seeds']}, Holm-adjusted over the routers of the column."
        )
    else:
        caption += " No significance test (no reference router, or fewer than two seeds shared with it)."
    headers = ("Router", "seeds", *(labels.get(c, c) for c in comparison.columns))
    return Table(name, caption, headers, tuple(rows))


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
        rows.append(
            (
                labels[record.run_id],
                _fmt(e.iter_time_ms, ".1f"),
                _fmt_tflops(e.tflops_per_device_analytic),
                _fmt_tflops(e.tflops_per_device_measured),
                _fmt(e.tokens_per_s, ".0f"),
                _fmt(memory, ".2f"),
                _fmt(e.mean_active_experts, ".3f"),
                _fmt(statistics.fmean(groups) if groups else None, ".0f"),
                str(e.num_devices),
                record.environment.device,
                e.backend or MISSING,
                parity[record.run_id].note,
            )
        )
        for source, entries in _published_groups(record, ledger or (), "efficiency.").items():
            ms = entries.get("efficiency.iter_time_ms")
            tf = entries.get("efficiency.tflops_per_device")
            setting = next(iter(entries.values())).setting
            rows.append(
                (
                    f"{record.experiment.router} [{source}]",
                    _fmt(ms.value if ms else None, ".1f"),
                    _fmt_tflops(tf.value if tf else None),
                    MISSING,
                    MISSING,
                    MISSING,
                    MISSING,
                    MISSING,
                    MISSING if setting.num_devices is None else str(setting.num_devices),
                    setting.hardware or MISSING,
                    MISSING,
                    f"published, {setting.model}",
                )
            )
    headers = (
        "Router",
        "ms/iter",
        "TFLOP/s/dev (analytic)",
        "TFLOP/s/dev (measured)",
        "tokens/s",
        "peak mem (GiB)",
        "active experts",
        "token group",
        "devices",
        "device",
        "backend",
        "compute parity",
    )
    caption = (
        "Training efficiency. ms/iter and tokens/s (all devices): medians over the steps after warm-up. "
        "TFLOP/s per device by Megatron-LM's model-FLOPs count at the nominal k (analytic) and at the measured "
        "mean experts per token (measured). Token group: tokens that compete for the experts together, for "
        "routers whose choice couples tokens (Expert Choice; -- for the others). Backend: the modules "
        "megatron-core built (te: TransformerEngine; torch: torch's grouped GEMM and SDPA; local: megatron's "
        "local spec). Compute parity: measured "
        "expert FLOPs per token within "
        f"+-{parity_tolerance * 100:g}% of the reference run (router '{reference_router}' where present)."
    )
    if ledger is not None:
        caption += " Rows 'router [paper table]' are published numbers for the same model."
    return Table("efficiency", caption, headers, tuple(rows))


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


# ------------------------------------------------------------------------------------------ rendering
_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}",
}


_LATEX_SPECIAL[PLUS_MINUS] = r"\ensuremath{\pm}"
_LATEX_SPECIAL[PARTIAL] = r"\ensuremath{^\dagger}"


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(char, char) for char in text)


def _is_number(cell: str) -> bool:
    """A number, ``number +- number`` (optionally marked), or missing."""
    parts = cell.rstrip(SIGNIFICANT + PARTIAL).split(f" {PLUS_MINUS} ")
    try:
        [float(part) for part in parts]
    except ValueError:
        return cell == MISSING
    return len(parts) <= 2


def _alignment(table: Table) -> tuple[str, ...]:
    """Numbers right, text left (a column is numeric when every cell is a number or missing)."""
    columns = list(zip(*table.rows)) or [()] * len(table.headers)
    return tuple("right" if cells and all(map(_is_number, cells)) else "left" for cells in columns)


def render(table: Table, fmt: str) -> str:
    """Render a table.

    Args:
        table: the table.
        fmt: ``md`` (caption, then a GitHub table), ``csv`` (header and rows only) or ``tex`` (a ``table``
            float with caption and label, booktabs rules).

    Returns:
        The text, ending in a newline.
    """
    align = _alignment(table)
    if fmt == "md":
        body = tabulate(table.rows, headers=table.headers, tablefmt="github", disable_numparse=True, colalign=align)
        return f"{table.caption}\n\n{body}\n"
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(table.headers)
        writer.writerows(table.rows)
        return buffer.getvalue()
    if fmt == "tex":
        body = tabulate(
            table.rows, headers=table.headers, tablefmt="latex_booktabs", disable_numparse=True, colalign=align
        ).replace(PLUS_MINUS, _LATEX_SPECIAL[PLUS_MINUS]).replace(PARTIAL, _LATEX_SPECIAL[PARTIAL])
        return (
            "\\begin{table}[ht]\n\\centering\n"
            f"\\caption{{{_latex_escape(table.caption)}}}\n\\label{{tab:{table.name}}}\n"
            f"{body}\n\\end{{table}}\n"
        )
    raise ReproError(f"unknown table format '{fmt}'; valid: {', '.join(FORMATS)}")


_GENERATED = {
    "md": "<!-- generated by `python -m repro tables` from run records; do not edit -->\n\n",
    "tex": "% generated by `python -m repro tables` from run records; do not edit\n",
}


def write_tables(tables: Sequence[Table], out_dir: str | Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Write each table in each format to ``out_dir/<name>.<fmt>``, atomically.

    Args:
        tables: the tables.
        out_dir: destination directory (created).
        formats: any of ``md``, ``csv``, ``tex``.

    Returns:
        The paths written.
    """
    for fmt in formats:
        if fmt not in FORMATS:
            raise ReproError(f"unknown table format '{fmt}'; valid: {', '.join(FORMATS)}")
    written = []
    for table in tables:
        for fmt in formats:
            path = Path(out_dir) / f"{table.name}.{fmt}"
            with atomic_path(path) as tmp:
                tmp.write_text(_GENERATED.get(fmt, "") + render(table, fmt))
            written.append(path)
    return written
