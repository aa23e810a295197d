"""Plots of a comparison (matplotlib, PNG): loss curves, routing over training, DirMoE's sparsity knob,
expert specialisation by domain. Every function takes plain data (training-log rows, analysis dicts) and a path.
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
from repro.training.log import LogRow  # noqa: E402


def _save(fig, path: str | os.PathLike) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_loss_curves(
    logs: Mapping[str, Sequence[LogRow]],
    path: str | os.PathLike,
    unigram_loss: float | None = None,
    smooth: int = 10,
) -> None:
    """LM loss against step for every run.

    Args:
        logs: ``{run label: training-log rows}`` (:class:`repro.training.log.LogRow`).
        path: the PNG to write.
        unigram_loss: drawn as a reference line (the loss of predicting token frequencies).
        smooth: moving-average window in steps.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in logs.items():
        steps = [r.step for r in rows]
        ax.plot(steps, _smooth([r.lm_loss for r in rows], smooth), label=label, lw=1.4)
    if unigram_loss is not None:
        ax.axhline(unigram_loss, color="grey", ls="--", lw=1, label=f"unigram ({unigram_loss:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"LM loss (nats/token, {smooth}-step mean)")
    ax.set_title("Training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    _save(fig, path)


def plot_routing_over_training(
    logs: Mapping[str, Sequence[LogRow]], path: str | os.PathLike, smooth: int = 10
) -> None:
    """Active experts per token and Simpson index of the combine weights (mean over layers) against step.

    Args:
        logs: ``{run label: training-log rows}`` (rows with ``active_experts`` and ``simpson`` per layer).
        path: the PNG to write.
        smooth: moving-average window in steps.
    """
    fig, (ax_a, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, rows in logs.items():
        rows = [r for r in rows if r.routing.get("active_experts")]
        if not rows:
            continue
        steps = [r.step for r in rows]
        active = [r.layer_mean("active_experts") for r in rows]
        simpson = [r.layer_mean("simpson") for r in rows]
        ax_a.plot(steps, _smooth(active, smooth), label=label, lw=1.4)
        ax_s.plot(steps, _smooth(simpson, smooth), label=label, lw=1.4)
    ax_a.set_title("Active experts per token (mean over layers)")
    ax_s.set_title("Simpson index of the combine weights")
    for ax in (ax_a, ax_s):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_a.legend(fontsize=8)
    _save(fig, path)


def plot_sparsity_knob(knob: Mapping[str, Sequence[float]], path: str | os.PathLike, num_experts: int) -> None:
    """Expected Simpson index of DirMoE's posterior draws against lambda_q: the Lemma and Monte Carlo.

    Args:
        knob: :func:`repro.analysis.sparsity_knob` output.
        path: the PNG to write.
        num_experts: E (the 1/E floor is drawn).
    """
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.plot(knob["lambda"], knob["theory"], "-", lw=2, label="theory (Lemma, per-token bases)")
    ax.plot(knob["lambda"], knob["measured"], "o", ms=5, label="measured (Dirichlet draws)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.axhline(1.0 / num_experts, color="grey", lw=0.8, ls=":", label=f"1/E = {1 / num_experts:.3f}")
    for lam in knob.get("trained_lambda", []):
        ax.axvline(lam, color="C3", lw=1, ls="--", label=f"trained lambda_q = {lam:g}")
    ax.set_xscale("log")
    ax.set_xlabel("posterior scale lambda_q")
    ax.set_ylabel("E[sum_i theta_i^2]")
    ax.set_title("DirMoE sparsity knob (trained router, layer 1)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_specialisation(per_router: Mapping[str, Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Share of each domain's tokens routed to each expert, per layer, one row of panels per router.

    Args:
        per_router: ``{router label: repro.analysis.expert_specialisation output}``.
        path: the PNG to write.
    """
    labels = [k for k, v in per_router.items() if v.get("share")]
    if not labels:
        return
    num_layers = max(len(per_router[k]["share"]) for k in labels)
    fig, axes = plt.subplots(
        len(labels), num_layers, figsize=(4.6 * num_layers, 3.0 * len(labels)), squeeze=False, sharey=True
    )
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
            ax.set_xticks(range(E))
            ax.set_xlabel("expert")
            if layer == 0:
                ax.set_ylabel("share of domain's tokens")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("Expert specialisation by domain (grey: uniform)", y=1.0)
    fig.tight_layout()
    _save(fig, path)


def specialisation_score(spec: Mapping[str, Any]) -> float:
    """Mean over layers and domains of the total-variation distance between a domain's expert shares and
    the average over domains: 0 when every domain is routed alike, up to 1 when domains use disjoint experts.
    """
    scores = []
    for share_XE in spec.get("share", []):
        if not share_XE:
            continue
        E = len(share_XE[0])
        mean_E = [sum(row[e] for row in share_XE) / len(share_XE) for e in range(E)]
        scores += [0.5 * sum(abs(row[e] - mean_E[e]) for e in range(E)) for row in share_XE]
    return sum(scores) / len(scores) if scores else math.nan
