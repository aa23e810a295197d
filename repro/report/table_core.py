"""What every generated table shares: the :class:`Table`, its constants and number formats, the zero-shot
columns, the partial-run marks, and rendering (:func:`render`, :func:`write_tables`)."""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tabulate import tabulate

from repro.errors import ReproError
from repro.evaluation.local_tasks import LOCAL_TASK_LABELS
from repro.io_utils import atomic_path
from repro.records.run_record import PartialTask, RunRecord, lm_eval_metrics, partial_tasks

if TYPE_CHECKING:  # scipy behind it: not for a type hint
    from repro.stats import Interval

#: The papers' zero-shot tasks (lm-eval names) and their column labels, in the papers' order.
PAPER_TASKS: dict[str, str] = {
    "arc_challenge": "ARC-c", "arc_easy": "ARC-e", "boolq": "BoolQ", "hellaswag": "HellaSwag",
    "lambada_openai": "LAMBADA", "piqa": "PIQA", "race": "RACE",
}
ZERO_SHOT_METRICS = ("auto", "acc", "acc_norm")
FORMATS = ("md", "csv", "tex")
MISSING = "--"
PLUS_MINUS = "±"
SIGNIFICANT = "*"
#: Marks a zero-shot cell scored on part of the task's documents (lm-eval's ``limit``).
PARTIAL = "†"
#: The suffix of a model's dense counterpart (``tiny-dense``, ``185m-dense``: repro.flavours).
DENSE_SUFFIX = "-dense"


@dataclass(frozen=True)
class Table:
    """A generated table: its file stem (``zero_shot``), a caption saying what the numbers are and how they were
    chosen, column labels, and rows of cells already formatted as text."""

    name: str
    caption: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def mean_or_none(values: Sequence[float | None]) -> float | None:
    """The mean of ``values``; None when there are none or one is missing."""
    return statistics.fmean(values) if values and None not in values else None


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return MISSING
    text = format(value, spec)
    return format(0.0, spec) if float(text) == 0 else text  # no "-0.00" from rounding


def _fmt_pm(value: float | None, error: float | None, mark: str = "", spec: str = ".2f") -> str:
    """``value +- error`` (``value`` alone where there is no error), then ``mark``."""
    if value is None:
        return MISSING
    text = _fmt(value, spec) if error is None else f"{_fmt(value, spec)} {PLUS_MINUS} {_fmt(error, spec)}"
    return text + mark


def fmt_interval(interval: Interval | None, spec: str, mark: str = "") -> str:
    """``mean +- half-width`` of an interval over seeds, then ``mark`` (``--`` for none)."""
    return MISSING if interval is None else _fmt_pm(interval.estimate, interval.half_width, mark, spec)


def record_partial(record: RunRecord) -> dict[str, PartialTask]:
    """task -> :class:`~repro.records.run_record.PartialTask` for tasks scored on part of their documents: the
    ``partial`` field, else (records without it) lm-eval's ``n-samples`` / ``config.limit``."""
    found = {p.task: p for p in partial_tasks(record.lm_eval)}
    found.update({p.task: p for p in record.partial})
    return found


def _partial_note(partial: Mapping[str, Mapping[str, PartialTask]]) -> str:
    """The dagger's caption sentence, runs cut alike named together ('' when none)."""
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


# ------------------------------------------------------------------------------------------ zero-shot columns
def choose_metric(task: str, records: Sequence[RunRecord], metric: str = "auto") -> str:
    """The lm-eval metric shown for ``task``: ``metric``; ``auto``: acc_norm if every run has it, else acc."""
    if metric not in ZERO_SHOT_METRICS:
        raise ReproError(f"unknown zero-shot metric '{metric}'; valid: {', '.join(ZERO_SHOT_METRICS)}")
    if metric != "auto":
        return metric
    reported = [m[task] for m in map(lm_eval_metrics, records) if task in m]
    return "acc_norm" if reported and all("acc_norm" in m for m in reported) else "acc"


def zero_shot_columns(
    records: Sequence[RunRecord], metric: str = "auto", published: Sequence[str] = ()
) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, str]]:
    """The zero-shot task columns: the papers' tasks measured (or published), in their order, then the others.

    Returns:
        ``(scores, chosen)``: run_id -> :func:`~repro.records.run_record.lm_eval_metrics`, and task -> its metric
        (:func:`choose_metric`), in column order.
    """
    scores = {r.run_id: lm_eval_metrics(r) for r in records}
    measured = {t for s in scores.values() for t, m in s.items() if "acc" in m or "acc_norm" in m}
    tasks = [t for t in PAPER_TASKS if t in measured or t in published] + sorted(measured - set(PAPER_TASKS))
    return scores, {t: choose_metric(t, records, metric) for t in tasks}


def metric_text(chosen: Mapping[str, str]) -> str:
    """The captions' ``Metric per column`` list: ``ARC-c acc_norm, ...`` (``none`` without columns)."""
    return ", ".join(f"{task_label(t)} {metric}" for t, metric in chosen.items()) or "none"


def task_label(task: str) -> str:
    """A task's column label (``ARC-c``, ``Continuation (local)``; the lm-eval name where it has none)."""
    return PAPER_TASKS.get(task) or LOCAL_TASK_LABELS.get(task, task)


# ------------------------------------------------------------------------------------------ rendering
_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}",
    PLUS_MINUS: r"\ensuremath{\pm}", PARTIAL: r"\ensuremath{^\dagger}",
}


def _is_number(cell: str) -> bool:
    """A number, ``number +- number`` (optionally marked), or missing."""
    parts = cell.rstrip(SIGNIFICANT + PARTIAL).split(f" {PLUS_MINUS} ")
    try:
        [float(part) for part in parts]
    except ValueError:
        return cell == MISSING
    return len(parts) <= 2


def render(table: Table, fmt: str) -> str:
    """``table`` as ``md`` (caption, GitHub table), ``csv`` (header and rows) or ``tex`` (booktabs ``table`` float),
    ending in a newline; numbers right and text left (a column is numeric when every cell is a number or missing)."""
    columns = list(zip(*table.rows)) or [()] * len(table.headers)
    align = tuple("right" if cells and all(map(_is_number, cells)) else "left" for cells in columns)
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
            f"\\caption{{{''.join(_LATEX_SPECIAL.get(c, c) for c in table.caption)}}}\n\\label{{tab:{table.name}}}\n"
            f"{body}\n\\end{{table}}\n"
        )
    raise ReproError(f"unknown table format '{fmt}'; valid: {', '.join(FORMATS)}")


_GENERATED = {
    "md": "<!-- generated by `python -m repro report tables` from run records; do not edit -->\n\n",
    "tex": "% generated by `python -m repro report tables` from run records; do not edit\n",
}


def write_tables(tables: Sequence[Table], out_dir: str | Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Write each table in each format (any of ``md``, ``csv``, ``tex``) to ``out_dir/<name>.<fmt>`` (the directory
    created), atomically; return the paths written."""
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
