"""Auxiliary-loss-free balancing: sigmoid top-k routing with a per-expert bias moved toward balance each step.

References:
    Wang, Gao, Zhao, Sun, Dai, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"
    (arXiv:2408.15664, 2024): a bias b_i added to the gating scores for the top-k choice only, updated after
    every step by ``b_i <- b_i + u * sign(mean_j c_j - c_i)`` (c_i: tokens routed to expert i in the step),
    u = 1e-3, no auxiliary loss.
    DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv:2412.19437), section 2.1.2: the same bias with sigmoid
    affinities, the top-k affinities normalised to sum to one, and a complementary sequence-wise balance
    loss with a tiny coefficient (alpha = 1e-4).
    Code: megatron-core 0.16.1 ``TopKRouter`` with ``moe_router_score_function="sigmoid"``,
    ``moe_router_enable_expert_bias=True``, ``moe_router_bias_update_rate``,
    ``moe_router_topk_scaling_factor`` (``router.py``; ``get_updated_expert_bias`` in ``moe_utils.py``, called
    from ``distributed/finalize_model_grads.py``), whose routing function this router calls.

Shape legend: T tokens, D hidden size, E experts, S sequence length, B sequences (see :mod:`routers.base`).
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
from routers.base import RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, require
from routers.metrics import routing_metrics
from routers.registry import register_router


@dataclass(frozen=True)
class AuxFreeConfig(RouterConfig):
    """Options of the aux-loss-free router; each maps to one megatron-core ``TransformerConfig`` field."""

    bias_update_rate: float = 1e-3  # u of the bias update (moe_router_bias_update_rate; both papers: 1e-3)
    # A constant multiplying the combine weights (moe_router_topk_scaling_factor; DeepSeek-V3's 2.5 goes with
    # its 8 of 256 experts). None: no scaling, as Wang et al.
    topk_scaling_factor: float | None = None
    # alpha of DeepSeek-V3's complementary sequence-wise balance loss (megatron's seq_aux_loss with
    # moe_aux_loss_coeff). Default 0: the method as Wang et al. define it, without any balance gradient, so the
    # comparison isolates what the bias does; DeepSeek-V3 sets 1e-4.
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

    ``s = sigmoid(W h)``; the k experts with the largest ``s + b`` receive the token, with combine weights from
    ``s`` alone: normalised over the k chosen for k > 1, ``s`` itself for k = 1 (a normalised single weight
    would be 1 and pass no gradient to the gate), times ``topk_scaling_factor`` when set. This is
    megatron-core's ``topk_routing_with_score_function`` with ``score_function="sigmoid"`` and
    ``expert_bias=b``, called here.

    The bias ``b`` (persistent float32 buffer ``expert_bias``, so checkpoints carry it) moves once per
    optimizer step by ``b <- b + u * sign(mean(c) - c)`` (megatron's ``get_updated_expert_bias``), c the
    step's routing counts of the training forwards with grad, summed over the data-parallel ranks
    (``routers.end_step``). megatron-core applies the update in ``finalize_model_grads``, before the optimizer
    step; the bias plays no part in the gradients, so updating after it gives the same values.

    Aux loss: ``seq_load_balancing_loss`` (when its coefficient is > 0; ``seq_shape`` gives the sequences,
    ``None`` one sequence of T tokens). Metric: ``expert_bias`` ``[E]``.
    """

    Config = AuxFreeConfig
    # The bias moves by steps of 1e-3, which vanish in bf16.
    fp32_buffers = ("expert_bias", "tokens_per_expert")

    def __init__(self, config: AuxFreeConfig) -> None:
        super().__init__(config)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # The step's routing counts: reset by end_step, so a checkpoint taken between steps needs none.
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32), persistent=False)

    @property
    def constraint(self) -> RoutingConstraint:
        cfg = self.config
        return RoutingConstraint(
            RoutingKind.EXACT_K, cfg.top_k, cfg.top_k, top_k=cfg.top_k,
            probs_sum_to_one=cfg.top_k > 1 and cfg.topk_scaling_factor in (None, 1.0),
        )

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        cfg = self.config
        T = hidden_TD.shape[0]
        logits_TE = self.logits(hidden_TD)
        probs_TE, routing_map_TE = topk_routing_with_score_function(
            logits_TE, cfg.top_k, scaling_factor=cfg.topk_scaling_factor, score_function="sigmoid",
            expert_bias=self.expert_bias,
        )
        with_grad = self.training and torch.is_grad_enabled()
        aux_losses: dict[str, torch.Tensor] = {}
        if with_grad and cfg.seq_aux_loss_coeff > 0:
            aux_losses["seq_load_balancing_loss"] = self._seq_aux_loss(logits_TE, seq_shape or (T, 1))
        if with_grad:
            # Only training forwards with grad count (megatron: not evaluation, not a recomputation's first pass).
            with torch.no_grad():
                self.tokens_per_expert += routing_map_TE.sum(0)

        metrics: dict[str, torch.Tensor] = {}
        if self.collect_metrics:
            metrics = routing_metrics(probs_TE, routing_map_TE)
            metrics["expert_bias"] = self.expert_bias.detach().clone()
        return RouterOutput(probs_TE.float(), routing_map_TE, aux_losses, metrics)

    def _seq_aux_loss(self, logits_TE: torch.Tensor, seq_shape: tuple[int, int]) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, megatron-core's ``seq_aux_loss``: the Switch loss of each
        sequence on the normalised (unbiased) sigmoid scores, averaged over the B sequences."""
        cfg = self.config
        S, B = seq_shape
        aux_map_TE, scores_TE = compute_routing_scores_for_aux_loss(logits_TE, cfg.top_k, "sigmoid")
        # [S*B, E] in megatron's order t = s*B + b -> [S, B*E]: one "expert" column per (sequence, expert).
        scores_SX, aux_map_SX = scores_TE.reshape(S, -1), aux_map_TE.reshape(S, -1)
        loss = switch_load_balancing_loss_func(
            scores_SX, aux_map_SX.sum(0), S, cfg.top_k, cfg.num_experts, cfg.seq_aux_loss_coeff
        )
        return loss / B

    # ------------------------------------------------------------ step schedule
    def step_statistic(self) -> torch.Tensor | None:
        """The ``[E]`` tokens routed to each expert by this layer's training forwards since the last step (per
        expert: ``routers.end_step`` sums it over the data-parallel ranks for this layer alone)."""
        return self.tokens_per_expert

    def end_step(self, global_statistic: torch.Tensor | None) -> None:
        """``b <- b + u * sign(mean(c) - c)`` with the step's ``[E]`` counts c summed over micro-batches and
        data-parallel ranks, then reset the counts. All zero (no training forward) leaves the bias unchanged,
        as in megatron-core."""
        if global_statistic is not None:
            with torch.no_grad():
                tokens_E = global_statistic.to(self.expert_bias.device, torch.float32)
                offset_E = tokens_E.sum(dim=-1, keepdim=True) / tokens_E.shape[-1] - tokens_E
                self.expert_bias.add_(torch.sign(offset_E) * self.config.bias_update_rate)
        self.tokens_per_expert.zero_()
