"""What the baselines share: the linear gate of the learned ones (all but Hash) and the diagnostics several
report. Shape legend: :mod:`routers.base`."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
from torch import nn

from routers.base import Router, RouterConfig


class GatedRouter(Router):
    """A router with a bias-free float32 linear gate ``weight`` ``[E, D]`` ~ N(0, init_std^2) (default 0.01, the
    models' ``init_method_std``), in megatron-core's ``Router.weight`` layout (copies to/from TopKRouter as is)."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        nn.init.normal_(self.weight, mean=0.0, std=config.init_std)

    def logits(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """``[..., E]`` ``hidden @ weight^T``, float32 even under autocast (megatron's ``moe_router_dtype='fp32'``)."""
        with torch.autocast(device_type=hidden_TD.device.type, enabled=False):
            return hidden_TD.float() @ self.weight.float().t()


def balance_metric(scores_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """megatron-core's switch load-balancing loss with coefficient 1, detached: the ``balance_loss`` metric."""
    with torch.no_grad():
        return switch_load_balancing_loss_func(
            scores_TE.detach(), tokens_per_expert_E, scores_TE.shape[0], config.top_k, config.num_experts, 1.0
        )


def z_loss_metric(logits_TE: torch.Tensor) -> torch.Tensor:
    """The unscaled router z-loss ``mean_t logsumexp(logits_t)^2`` (ST-MoE), detached."""
    return torch.logsumexp(logits_TE.detach(), -1).square().mean()
