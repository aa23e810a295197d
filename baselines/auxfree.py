"""Auxiliary-loss-free balancing: sigmoid top-k routing with a per-expert bias moved toward balance each step.

References:
    Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts" (arXiv:2408.15664): a bias
    b_i on the gating scores for the top-k choice only, after every step ``b_i <- b_i + u * sign(mean_j c_j - c_i)``
    (c_i: the step's tokens to expert i), u = 1e-3, no aux loss.
    DeepSeek-V3 Technical Report (arXiv:2412.19437), Sec. 2.1.2: the same bias with sigmoid affinities, the top-k
    normalised to sum to one, and a sequence-wise balance loss (alpha = 1e-4).
    Code: megatron-core 0.16.1 ``TopKRouter`` with ``moe_router_score_function="sigmoid"`` and the expert bias
    options; ``get_updated_expert_bias`` (``moe_utils.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import (
    compute_routing_scores_for_aux_loss,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
)

from baselines._gate import GatedRouter
from routers import RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, register_router
from routers.base import require


@dataclass(frozen=True)
class AuxFreeConfig(RouterConfig):
    """Options of the aux-loss-free router; each maps to one megatron-core ``TransformerConfig`` field."""

    bias_update_rate: float = 1e-3  # u of the bias update (moe_router_bias_update_rate; both papers: 1e-3)
    # moe_router_topk_scaling_factor (DeepSeek-V3's 2.5 suits 8 of 256 experts); None: unscaled, as Wang et al.
    topk_scaling_factor: float | None = None
    # alpha of DeepSeek-V3's sequence-wise balance loss (1e-4 there); 0: Wang et al.'s, isolating the bias.
    seq_aux_loss_coeff: float = 0.0
    init_std: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.bias_update_rate > 0, "bias_update_rate", self.bias_update_rate, "> 0")
        scale = self.topk_scaling_factor
        require(scale is None or scale > 0, "topk_scaling_factor", scale, "None or > 0")
        require(self.seq_aux_loss_coeff >= 0, "seq_aux_loss_coeff", self.seq_aux_loss_coeff, ">= 0")
        require(self.init_std > 0, "init_std", self.init_std, "> 0")


@register_router("auxfree")
class AuxFreeRouter(GatedRouter):
    """Sigmoid top-k routing balanced by a per-expert bias outside the gradient (DeepSeek-V3; Wang et al. 2024).

    ``s = sigmoid(W h)``; the k largest ``s + b`` get the token, weighted by ``s`` normalised over the k (raw at
    k = 1: a normalised single weight is 1, no gradient), times ``topk_scaling_factor`` if set. The bias (float32
    buffer ``expert_bias``) moves after each optimizer step (:meth:`end_step`; megatron-core's before it gives the
    same values, b being outside the gradients). Aux loss: ``seq_load_balancing_loss``. Metric: ``expert_bias``.
    """

    Config = AuxFreeConfig
    fp32_buffers = ("expert_bias", "tokens_per_expert")  # the bias moves by steps of 1e-3, which vanish in bf16

    def __init__(self, config: AuxFreeConfig) -> None:
        super().__init__(config)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # The step's counts: reset by end_step, so checkpoints between steps need none.
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32), persistent=False)

    @property
    def constraint(self) -> RoutingConstraint:
        k = self.top_k
        sums_to_one = k > 1 and self.config.topk_scaling_factor in (None, 1.0)
        return RoutingConstraint(RoutingKind.EXACT_K, k, k, top_k=k, probs_sum_to_one=sums_to_one)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        cfg = self.config
        logits_TE = self.logits(hidden_TD)
        probs_TE, routing_map_TE = topk_routing_with_score_function(
            logits_TE, cfg.top_k, scaling_factor=cfg.topk_scaling_factor, score_function="sigmoid",
            expert_bias=self.expert_bias,
        )
        aux_losses: dict[str, torch.Tensor] = {}
        if self.training and torch.is_grad_enabled():
            if cfg.seq_aux_loss_coeff > 0:
                # DeepSeek-V3's sequence-wise loss (megatron's seq_aux_loss): each sequence's Switch loss on the
                # normalised unbiased sigmoid scores, averaged over sequences; [S*B, E] in megatron's order
                # t = s*B + b -> [S, B*E]: one "expert" column per (sequence, expert).
                S, B = seq_shape or (hidden_TD.shape[0], 1)
                aux_map_TE, scores_TE = compute_routing_scores_for_aux_loss(logits_TE, cfg.top_k, "sigmoid")
                aux_losses["seq_load_balancing_loss"] = switch_load_balancing_loss_func(
                    scores_TE.reshape(S, -1), aux_map_TE.reshape(S, -1).sum(0), S, cfg.top_k, cfg.num_experts,
                    cfg.seq_aux_loss_coeff,
                ) / B
            # Training forwards with grad only (megatron: not evaluation, not a recomputation's first pass).
            with torch.no_grad():
                self.tokens_per_expert += routing_map_TE.sum(0)
        return self.output(
            probs_TE.float(), routing_map_TE, aux_losses, lambda: {"expert_bias": self.expert_bias.detach().clone()}
        )

    def step_statistic(self) -> torch.Tensor | None:
        """``[E]`` tokens per expert of this layer's training forwards this step (summed over ranks, per layer)."""
        return self.tokens_per_expert

    def end_step(self, global_statistic: torch.Tensor | None) -> None:
        """``b <- b + u * sign(mean(c) - c)`` with this step's ``[E]`` counts c, then reset them (all zero: no-op)."""
        if global_statistic is not None:
            with torch.no_grad():
                tokens_E = global_statistic.to(self.expert_bias.device, torch.float32)
                offset_E = tokens_E.sum(dim=-1, keepdim=True) / tokens_E.shape[-1] - tokens_E
                self.expert_bias.add_(torch.sign(offset_E) * self.config.bias_update_rate)
        self.tokens_per_expert.zero_()
