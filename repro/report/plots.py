"""Plots of a comparison (matplotlib, PNG): loss curves, routing over training, DirMoE's sparsity knob,
expert specialisation by domain, and the DirMoE ablation's. Every function takes plain data (training-log rows,
:class:`repro.records.step_log.LogRow`; analysis dicts) and ``path``, the PNG to write.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: no display on CI or GPU nodes
import matplotlib.pyplot as plt  # noqa: E402

from repro.io_utils import atomic_path  # noqa: E402
from repro.records.step_log import LogRow  # noqa: E402

#: The moving-average window of the curves over training, in steps.
SMOOTH = 10


def _save(fig, path: str | os.PathLike, tight: bool = True) -> None:
    if tight:
        fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)


def _grid(panels: int, ncols: int, size: tuple[float, float], **options: Any):
    """A figure of ``panels`` panels, ``ncols`` a row, each ``size`` inches; spare panels hidden."""
    nrows = math.ceil(panels / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False, **options)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, axes


def _smooth(values: Sequence[float]) -> list[float]:
    windows = [values[max(0, i + 1 - SMOOTH):i + 1] for i in range(len(values))]
    return [sum(w) / len(w) for w in windows]


def plot_loss_curves(
    logs: Mapping[str, Sequence[LogRow]], path: str | os.PathLike, unigram_loss: float | None = None
) -> None:
    """LM loss against step per run (``logs``: label -> rows), with ``unigram_loss`` as a reference line."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in logs.items():
        ax.plot([r.step for r in rows], _smooth([r.lm_loss for r in rows]), label=label, lw=1.4)
    if unigram_loss is not None:
        ax.axhline(unigram_loss, color="grey", ls="--", lw=1, label=f"unigram ({unigram_loss:.2f})")
    ax.set(xlabel="step", ylabel=f"LM loss (nats/token, {SMOOTH}-step mean)", title="Training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    _save(fig, path, tight=False)


def plot_routing_over_training(logs: Mapping[str, Sequence[LogRow]], path: str | os.PathLike) -> None:
    """Active experts per token and Simpson index of combine weights (layer mean) against step, per run."""
    fig, (ax_a, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, rows in logs.items():
        rows = [r for r in rows if r.routing.get("active_experts")]
        for ax, metric in ((ax_a, "active_experts"), (ax_s, "simpson")) if rows else ():
            ax.plot([r.step for r in rows], _smooth([r.layer_mean(metric) for r in rows]), label=label, lw=1.4)
    ax_a.set_title("Active experts per token (mean over layers)")
    ax_s.set_title("Simpson index of the combine weights")
    for ax in (ax_a, ax_s):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_a.legend(fontsize=8)
    _save(fig, path, tight=False)


def plot_sparsity_knob(knob: Mapping[str, Sequence[float]], path: str | os.PathLike, num_experts: int) -> None:
    """Expected Simpson index of DirMoE's draws against lambda_q (Lemma, Monte Carlo), above the 1/E floor."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.plot(knob["lambda"], knob["theory"], "-", lw=2, label="theory (Lemma, per-token bases)")
    ax.plot(knob["lambda"], knob["measured"], "o", ms=5, label="measured (Dirichlet draws)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.axhline(1.0 / num_experts, color="grey", lw=0.8, ls=":", label=f"1/E = {1 / num_experts:.3f}")
    for lam in knob.get("trained_lambda", []):
        ax.axvline(lam, color="C3", lw=1, ls="--", label=f"trained lambda_q = {lam:g}")
    ax.set(xscale="log", xlabel="posterior scale lambda_q", ylabel="E[sum_i theta_i^2]",
           title="DirMoE sparsity knob (trained router, layer 1)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(fig, path, tight=False)


def plot_specialisation(per_router: Mapping[str, Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Share of each domain's tokens per expert and layer, a row of panels per router."""
    labels = [k for k, v in per_router.items() if v.get("share")]
    if not labels:
        return
    num_layers = max(len(per_router[k]["share"]) for k in labels)
    fig, axes = _grid(len(labels) * num_layers, num_layers, (4.6, 3.0), sharey=True)
    for row, label in enumerate(labels):
        spec = per_router[label]
        domains, E = spec["domains"], spec["num_experts"]
        width = 0.8 / max(1, len(domains))
        for layer, share_XE in enumerate(spec["share"]):
            ax = axes[row][layer]
            for j, (domain, shares) in enumerate(zip(domains, share_XE)):
                ax.bar([e + (j - (len(domains) - 1) / 2) * width for e in range(E)], shares, width, label=domain)
            ax.axhline(1.0 / E, color="grey", ls="--", lw=1)
            ax.set_title(f"{label}: layer {layer + 1}", fontsize=9)
            ax.set(xticks=range(E), xlabel="expert")
            if layer == 0:
                ax.set_ylabel("share of domain's tokens")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("Expert specialisation by domain (grey: uniform)", y=1.0)
    _save(fig, path)


def specialisation_score(spec: Mapping[str, Any]) -> float:
    """Mean over layers and domains of the total-variation distance between a domain's expert shares and
    their average: 0 when domains route alike, up to 1 for disjoint experts.
    """
    scores = []
    for share_XE in spec.get("share", []):
        if not share_XE:
            continue
        E = len(share_XE[0])
        mean_E = [sum(row[e] for row in share_XE) / len(share_XE) for e in range(E)]
        scores += [0.5 * sum(abs(row[e] - mean_E[e]) for e in range(E)) for row in share_XE]
    return sum(scores) / len(scores) if scores else math.nan


# ------------------------------------------------------------------------------------- DirMoE ablation
def _per_step_mean(runs: Sequence[Sequence[LogRow]], metric: str, layer: int | None) -> tuple[list[int], list[float]]:
    """Steps and the seed mean of a scalar routing metric (one layer's, or the layer mean)."""
    by_step: dict[int, list[float]] = {}
    for rows in runs:
        for r in rows:
            values = r.routing.get(metric) or []
            value = r.layer_mean(metric) if layer is None else values[layer] if len(values) > layer else None
            if value is not None:
                by_step.setdefault(r.step, []).append(float(value))
    steps = sorted(by_step)
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def _num_layers(runs: Sequence[Sequence[LogRow]], metric: str) -> int:
    return max((len(r.routing.get(metric) or []) for rows in runs for r in rows), default=0)


def plot_expert_load(
    logs: Mapping[str, Sequence[LogRow]], path: str | os.PathLike,
    metric: str | Mapping[str, str] = "tokens_per_expert", title: str = "Share of each expert over training",
) -> None:
    """Each expert's share over training, stacked, per run and layer (two runs per row of panels).

    Args:
        logs: run label -> rows with ``routing_per_expert``.
        metric: ``tokens_per_expert`` (load) or ``weight_share`` (mean routing weight), or one per label.
        title: the figure's title.
    """
    labels = list(logs)
    which = {label: metric if isinstance(metric, str) else metric.get(label, "tokens_per_expert") for label in labels}
    num_layers = max((len(r.routing_per_expert.get(which[k]) or []) for k in labels for r in logs[k]), default=0)
    if num_layers == 0:
        return
    # Two runs to a row of panels, one panel per layer.
    fig, axes = _grid(len(labels) * num_layers, 2 * num_layers, (3.2, 2.2), sharey=True)
    num_experts = 0
    for index, label in enumerate(labels):
        rows = [r for r in logs[label] if r.routing_per_expert.get(which[label])]
        for layer in range(num_layers):
            ax = axes.flat[index * num_layers + layer]
            counts = [r.routing_per_expert[which[label]][layer] for r in rows if len(r.routing_per_expert[which[label]]) > layer]
            if not counts:
                continue
            steps = [r.step for r in rows][: len(counts)]
            num_experts = len(counts[0])
            shares = [[c / max(sum(row), 1e-30) for c in row] for row in counts]
            series = [_smooth([s[e] for s in shares]) for e in range(num_experts)]
            ax.stackplot(steps, series, linewidth=0)
            ax.axhline(1.0, color="black", lw=0.5)
            what = "r mass" if which[label] == "weight_share" else "load"
            ax.set_title(f"{label}: L{layer + 1} {what}", fontsize=8)
            ax.set_ylim(0, 1)
            ax.tick_params(labelsize=7)
    fig.suptitle(f"{title} (stacked; an even split is {num_experts} equal bands)", y=1.0, fontsize=10)
    _save(fig, path)


def plot_shared_mean(logs: Mapping[str, Sequence[Sequence[LogRow]]], path: str | os.PathLike) -> None:
    """DirMoE's shared-mean energy of the router input and the decoder columns' alignment with it, per layer,
    over training (seed means; ``logs``: cell label -> each seed's rows)."""
    metrics = (
        ("input_mean_energy", "shared-mean energy ||mean x||^2 / mean ||x||^2"),
        ("decoder_mean_alignment", "decoder columns: mean cos(column, mean x)"),
    )
    num_layers = max((_num_layers(runs, metrics[0][0]) for runs in logs.values()), default=0)
    if num_layers == 0:
        return
    # A distinct colour and line style per label (tab20 alone runs out beyond ten lines).
    cmap, dashes = plt.get_cmap("tab10"), ("-", "--", ":", "-.")
    styles = {label: {"color": cmap(i % 10), "ls": dashes[(i // 10) % len(dashes)]} for i, label in enumerate(logs)}
    fig, axes = plt.subplots(2, num_layers, figsize=(5.2 * num_layers, 7.5), squeeze=False, sharex=True)
    for row, (metric, title) in enumerate(metrics):
        for layer in range(num_layers):
            ax = axes[row][layer]
            for label, runs in logs.items():
                steps, values = _per_step_mean(runs, metric, layer)
                if steps:
                    ax.plot(steps, _smooth(values), lw=1.2, label=label, **styles[label])
            ax.set_title(f"{title}, layer {layer + 1}", fontsize=9)
            ax.grid(alpha=0.3)
            if row == len(metrics) - 1:
                ax.set_xlabel("step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle("The shared component of the router input and the decoder's columns (mean over seeds)", fontsize=10)
    _save(fig, path)


def plot_simpson_theta(logs: Mapping[str, Sequence[Sequence[LogRow]]], path: str | os.PathLike) -> None:
    """Simpson index of DirMoE's Dirichlet draws against the calibrator's target over training, a panel per
    cell (layer and seed means): the draws, the Lemma under the actual posterior, and the target at the posterior
    scale in use on an ideal active set and at the actual gates (had the heads kept the prior's bases).

    ``logs``: cell label -> each seed's rows.
    """
    labels = [k for k, runs in logs.items() if _num_layers(runs, "simpson_theta")]
    if not labels:
        return
    fig, axes = _grid(len(labels), min(4, len(labels)), (3.6, 2.8), sharex=True, sharey=True)
    lines = (
        ("simpson_theta", "draws theta", {"color": "C0", "ls": "-", "lw": 2.0}),
        ("simpson_theta_expected", "Lemma, actual posterior", {"color": "black", "ls": ":", "lw": 1.2}),
        ("simpson_theta_target", "target (ideal active set)", {"color": "C3", "ls": "--", "lw": 1.3}),
        ("simpson_theta_target_gates", "target (actual gates)", {"color": "C1", "ls": "-.", "lw": 1.3}),
    )
    for ax, label in zip(axes.flat, labels):
        for metric, name, style in lines:
            steps, values = _per_step_mean(logs[label], metric, None)
            if steps:
                ax.plot(steps, _smooth(values), label=name, **style)
        ax.set_title(label, fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Simpson index sum_i theta_i^2 of the Dirichlet draws vs the calibrator's target "
                 "(means over layers and seeds)", fontsize=10)
    _save(fig, path)


def plot_ablation_summary(
    intervals: Mapping[str, Mapping[str, tuple[float, float | None, float | None]]], path: str | os.PathLike,
    references: Sequence[str] = (),
) -> None:
    """One panel per column: each cell's mean with its interval over seeds, the references' intervals shaded.

    Args:
        intervals: ``{cell: {column label: (mean, low, high)}}`` (low/high None with one seed).
        path: the PNG.
        references: up to two cells whose intervals are shaded across each panel.
    """
    cells = list(intervals)
    columns = list(dict.fromkeys(c for cell in cells for c in intervals[cell]))
    if not columns:
        return
    colours = dict(zip([r for r in references if r in intervals], ("C3", "grey")))
    fig, axes = _grid(len(columns), min(3, len(columns)), (4.2, 0.3 * len(cells) + 1.2), sharey=True)
    y = {cell: len(cells) - 1 - i for i, cell in enumerate(cells)}
    for ax, column in zip(axes.flat, columns):
        for reference, colour in colours.items():
            if column not in intervals[reference]:
                continue
            mean, low, high = intervals[reference][column]
            if low is not None:
                ax.axvspan(low, high, color=colour, alpha=0.15, lw=0)
            ax.axvline(mean, color=colour, lw=1, ls="--")
        for cell in cells:
            if column not in intervals[cell]:
                continue
            mean, low, high = intervals[cell][column]
            err = None if low is None else [[mean - low], [high - mean]]
            ax.errorbar(mean, y[cell], xerr=err, fmt="o", ms=4, capsize=3, color=colours.get(cell, "C0"))
        ax.set_title(column, fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    for row in axes:
        row[0].set_yticks([y[c] for c in cells])
        row[0].set_yticklabels(cells, fontsize=8)
    names = {"C3": "red", "grey": "grey"}
    note = "".join(f"; {names[c]}: '{r}'" for r, c in colours.items())
    fig.suptitle(f"End-of-run values per cell: mean and 95% interval over seeds{note}", fontsize=10)
    _save(fig, path)
