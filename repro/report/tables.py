"""The paper's tables, generated from run records (never edited by hand).

Three tables, each a :class:`Table` rendered as Markdown, CSV or LaTeX (:func:`render`):

- :func:`zero_shot_table`: rows = runs, columns = ARC-c, ARC-e, BoolQ, HellaSwag, LAMBADA, PIQA, RACE (the
  ones any row has), then the local tasks of the embedded default, then Avg.;
- :func:`efficiency_table`: ms/iter, TFLOP/s per device (analytic and measured), tokens/s, peak memory,
  active experts and the compute-parity verdict;
- :func:`routing_table`: active experts per token, Simpson index, load imbalance and dropped mass, per layer.

With published numbers (a ledger, :mod:`repro.report.ledger`), each run is followed by the published rows of
its router measured in the same model setting, and a ``delta`` row (measured minus published).
"""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from repro.errors import ReproError
from repro.evaluation.local_tasks import LOCAL_TASK_LABELS
from repro.io_utils import atomic_path
from repro.report.ledger import PublishedEntry, select
from repro.report.parity import DEFAULT_PARITY_TOLERANCE, DEFAULT_REFERENCE_ROUTER, compute_parity
from repro.report.record import RunRecord, lm_eval_metrics

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


def _ordered(records: Sequence[RunRecord]) -> list[RunRecord]:
    """The dense baseline first, then routers by name, then run_id: tables do not depend on file names or
    argument order, and no router is placed by name."""
    return sorted(records, key=lambda r: (r.experiment.router != "dense", r.experiment.router, r.run_id))


def _labels(records: Sequence[RunRecord]) -> dict[str, str]:
    """Row label per run: the router, or ``router (run_id)`` where a router has several runs."""
    routers = [r.experiment.router for r in records]
    return {
        r.run_id: r.experiment.router if routers.count(r.experiment.router) == 1 else f"{r.experiment.router} ({r.run_id})"
        for r in records
    }


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

    def published_value(entries: dict[str, PublishedEntry], metric_name: str) -> float | None:
        entry = entries.get(metric_name)
        return None if entry is None else entry.value

    rows: list[tuple[str, ...]] = []
    labels = _labels(evaluated)
    for record in evaluated:
        values = [percent(record.run_id, t) for t in tasks]
        mean = avg(values)
        rows.append((labels[record.run_id], *(_fmt(v, ".2f") for v in values), _fmt(mean, ".2f")))
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
        "Avg. is the mean over the task columns shown."
    )
    if ledger is not None:
        caption += (
            " Rows 'router [paper table]' are published numbers for the same model (the papers do not say "
            "whether they report acc or acc_norm); 'delta' rows are measured minus published."
        )
    return Table("zero_shot", caption, headers, tuple(rows))


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
        "compute parity",
    )
    caption = (
        "Training efficiency. ms/iter and tokens/s (all devices): medians over the steps after warm-up. "
        "TFLOP/s per device by Megatron-LM's model-FLOPs count at the nominal k (analytic) and at the measured "
        "mean experts per token (measured). Token group: tokens that compete for the experts together, for "
        "routers whose choice couples tokens (Expert Choice; -- for the others). Compute parity: measured "
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


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(char, char) for char in text)


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return cell == MISSING
    return True


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
        )
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
