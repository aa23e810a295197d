"""Routing metrics shared by all routers, all detached (shape suffixes: :mod:`routers.base`)."""

from __future__ import annotations

import torch


def simpson_index(weights_TE: torch.Tensor) -> torch.Tensor:
    """Mean Simpson index sum_i p_i^2 of the tokens' normalised weights (unrouted tokens skipped; all: 0)."""
    w = weights_TE.detach().float()
    total_T = w.sum(-1)
    keep_T = total_T > 0
    if not bool(keep_T.any()):
        return torch.zeros((), device=w.device)
    p = w[keep_T] / total_T[keep_T, None]
    return (p * p).sum(-1).mean()


def routing_metrics(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics every router reports: ``active_experts`` (mean per token), ``max_active_experts``,
    ``unrouted_tokens`` (share), ``simpson`` (of the combine weights), ``tokens_per_expert`` ``[E]`` and
    ``load_imbalance`` (max / mean tokens per expert)."""
    with torch.no_grad():
        per_token_T = routing_map_TE.sum(-1).float()
        tokens_per_expert_E = routing_map_TE.sum(0).float()
        mean_load = tokens_per_expert_E.mean()
        return {
            "active_experts": per_token_T.mean(),
            "max_active_experts": per_token_T.max() if per_token_T.numel() else per_token_T.sum(),
            "unrouted_tokens": (per_token_T == 0).float().mean(),
            "simpson": simpson_index(probs_TE),
            "tokens_per_expert": tokens_per_expert_E,
            "load_imbalance": tokens_per_expert_E.max() / mean_load.clamp_min(1e-9),
        }
