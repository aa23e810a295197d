"""ReMoE: ReLU routing with a load-aware L1 penalty whose coefficient adapts to a target sparsity.

Reference:
    Wang, Zhu, Chen, "ReMoE: Fully Differentiable Mixture-of-Experts with ReLU Routing", ICLR 2025
    (arXiv:2412.14711). Code: github.com/thu-ml/ReMoE (``ReLURouter`` in ``megatron/core/transformer/moe/router.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

from baselines._gate import GatedRouter, balance_metric
from routers import RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, register_router
from routers.base import require


@dataclass(frozen=True)
class ReMoEConfig(RouterConfig):
    """Options of the ReMoE router (defaults: the paper's and its scripts')."""

    l1_coeff_init: float = 1e-8  # lambda_0, the initial L1 coefficient
    l1_coeff_multiplier: float = 1.2  # alpha > 1 of the update lambda <- lambda * alpha^sign(target - S)
    target_sparsity: float | None = None  # share of zero outputs to steer to; None: the paper's 1 - k/E
    init_std: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.l1_coeff_init > 0, "l1_coeff_init", self.l1_coeff_init, "> 0")
        require(self.l1_coeff_multiplier > 1, "l1_coeff_multiplier", self.l1_coeff_multiplier, "> 1")
        target = self.target_sparsity
        require(target is None or 0 <= target < 1, "target_sparsity", target, "None or in [0, 1)")
        require(self.init_std > 0, "init_std", self.init_std, "> 0")


@register_router("remoe")
class ReMoERouter(GatedRouter):
    """ReLU routing (ReMoE, Wang et al. ICLR 2025).

    ``R = relu(W h)``, unnormalised, are the combine weights; ``routing_map = R > 0`` (0 to E experts). Aux loss
    ``l1_reg_loss`` (training): ``lambda * E / (T^2 k) * sum_e (sum_t R_te) (sum_t 1[R_te > 0])``, as the
    reference megatron's ``switch_load_balancing_loss_func`` on R with coefficient lambda. After every optimizer
    step ``lambda <- lambda * alpha^sign(target - S)``, S the share of zeros in R averaged over the step's
    micro-batches, layers and ranks, so lambda (float32 buffer ``l1_coeff``) is the same in every layer (the
    reference holds one). Metrics: ``sparsity``, ``l1_coeff``, ``l1_reg`` (without lambda).
    """

    Config = ReMoEConfig
    # lambda is multiplied by 1.2 every step and must not be rounded to bf16.
    fp32_buffers = ("l1_coeff", "sparsity_sum")

    def __init__(self, config: ReMoEConfig) -> None:
        super().__init__(config)
        self.register_buffer("l1_coeff", torch.tensor(config.l1_coeff_init, dtype=torch.float32))
        # Per-step accumulators: reset by end_step, so checkpoints between steps need none.
        self.register_buffer("sparsity_sum", torch.zeros((), dtype=torch.float32), persistent=False)
        self.sparsity_count = 0  # a host integer, so deciding whether the step has a statistic needs no host sync

    @property
    def constraint(self) -> RoutingConstraint:
        return RoutingConstraint(RoutingKind.VARIABLE, 0, self.num_experts, top_k=self.top_k)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        cfg = self.config
        T = hidden_TD.shape[0]
        probs_TE = torch.relu(self.logits(hidden_TD))
        routing_map_TE = probs_TE > 0
        tokens_per_expert_E = routing_map_TE.sum(0)
        sparsity = 1.0 - routing_map_TE.float().mean()

        aux_losses: dict[str, torch.Tensor] = {}
        if self.training and torch.is_grad_enabled():
            # clone(): the loss must not hold the buffer itself, which end_step updates in place.
            aux_losses["l1_reg_loss"] = switch_load_balancing_loss_func(
                probs_TE, tokens_per_expert_E, T, cfg.top_k, cfg.num_experts, self.l1_coeff.clone()
            )
            # Training forwards with grad only (as the reference): not evaluation or a recomputation's first pass.
            with torch.no_grad():
                self.sparsity_sum += sparsity.detach()
                self.sparsity_count += 1
        return self.output(probs_TE, routing_map_TE, aux_losses, lambda: {
            "sparsity": sparsity.detach(),
            "l1_coeff": self.l1_coeff.detach().clone(),
            "l1_reg": balance_metric(probs_TE, tokens_per_expert_E, cfg),
        })

    def step_statistic(self) -> torch.Tensor | None:
        """Mean sparsity S of the training forwards since the last :meth:`end_step` (None if none)."""
        return self.sparsity_sum / self.sparsity_count if self.sparsity_count else None

    def end_step(self, global_statistic: torch.Tensor | None) -> None:
        """Apply ``lambda <- lambda * alpha^sign(target - S)`` (None: unchanged), then reset the accumulators."""
        if global_statistic is not None:
            # On the device (no sync): S vs the target in float64 (as Python); the float32 ops of in-place mul_/div_.
            s = global_statistic.detach().to(device=self.l1_coeff.device, dtype=torch.float64)
            cfg = self.config
            target = 1.0 - cfg.top_k / cfg.num_experts if cfg.target_sparsity is None else cfg.target_sparsity
            lam, alpha = self.l1_coeff, cfg.l1_coeff_multiplier
            self.l1_coeff.copy_(torch.where(s < target, lam * alpha, torch.where(s > target, lam / alpha, lam)))
        self.sparsity_sum.zero_()
        self.sparsity_count = 0
