"""Switch / dMoE: token-choice top-k routing with the load-balancing loss (megatron-core's TopKRouter).

References:
    Fedus, Zoph, Shazeer, "Switch Transformers", JMLR 2022 (arXiv:2101.03961): top-1 routing, load-balancing loss
    ``alpha * E * sum_i f_i P_i``, expert capacity with token dropping.
    Gale et al., "MegaBlocks", MLSys 2023 (arXiv:2211.15841): dMoE, the same router dropless.
    Zoph et al., "ST-MoE" (arXiv:2202.08906): the router z-loss.
    Code: megatron-core 0.16.1 ``moe/router.py`` (``TopKRouter``) and the ``moe_utils.py`` functions called here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import (
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)

from baselines._gate import GatedRouter, balance_metric, z_loss_metric
from routers import RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, register_router
from routers.base import require

DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class SwitchConfig(RouterConfig):
    """Options of the Switch / dMoE router; each maps to one megatron-core ``TransformerConfig`` field."""

    aux_loss_coeff: float = 1e-2  # alpha of the load-balancing loss (moe_aux_loss_coeff); 0 turns it off
    z_loss_coeff: float = 0.0  # coefficient of the router z-loss (moe_z_loss_coeff); 0 turns it off
    # Softmax before the top-k (moe_router_pre_softmax). None: True for k = 1 (a softmax over one logit has zero
    # gradient), else False. ReMoE's dMoE scripts pass it at every k, so runs compared with ReMoE at k > 1 set True.
    pre_softmax: bool | None = None
    # None: dropless (dMoE); c > 0 caps each expert at ceil((T * k / E) * c) tokens (moe_expert_capacity_factor)
    capacity_factor: float | None = None
    drop_policy: str = "probs"  # an over-full expert keeps "probs" (highest) or "position" (earliest) tokens
    init_std: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.aux_loss_coeff >= 0, "aux_loss_coeff", self.aux_loss_coeff, ">= 0")
        require(self.z_loss_coeff >= 0, "z_loss_coeff", self.z_loss_coeff, ">= 0")
        if self.pre_softmax is False and self.top_k == 1:
            raise ValueError(
                "pre_softmax must be True or None when top_k == 1 (megatron-core 0.16.1 requires softmax "
                "before a top-1 selection: a softmax over one logit has zero gradient)"
            )
        cf = self.capacity_factor
        require(cf is None or cf > 0, "capacity_factor", cf, "None (dropless) or > 0")
        require(self.drop_policy in DROP_POLICIES, "drop_policy", self.drop_policy, f"one of {DROP_POLICIES}")
        require(self.init_std > 0, "init_std", self.init_std, "> 0")

    @property
    def use_pre_softmax(self) -> bool:
        """The effective ``moe_router_pre_softmax`` (see ``pre_softmax``)."""
        return self.top_k == 1 if self.pre_softmax is None else self.pre_softmax


@register_router("switch")
class SwitchRouter(GatedRouter):
    """Token-choice top-k routing: Switch Transformer (k = 1) and dMoE, exactly megatron-core's TopKRouter.

    Optional capacity dropping; in training, the load-balancing loss ``alpha * E * sum_i f_i P_i`` (f_i: expert
    i's share of the k*T assignments before dropping, P_i: its mean softmax probability) and optionally the
    z-loss ``coeff * mean_t logsumexp(logits_t)^2``. Aux losses: ``load_balancing_loss``, ``z_loss``. Metrics:
    ``balance_loss``, ``z_loss`` (unscaled), ``dropped_fraction``. Unlike megatron-core, the counts are the local
    micro-batch's (megatron all-reduces them over the tensor/context-parallel group: a no-op at one rank).
    """

    Config = SwitchConfig
    # The 185M runs and their k sweeps follow ReMoE's dMoE scripts (see ``pre_softmax``).
    recipe_overrides = {"185m": ("router.options.pre_softmax=true",)}

    @property
    def constraint(self) -> RoutingConstraint:
        cfg, k = self.config, self.top_k
        if cfg.capacity_factor is None:
            # Dropless: exactly k; a post-top-k softmax makes the weights sum to one.
            return RoutingConstraint(RoutingKind.EXACT_K, k, k, top_k=k, probs_sum_to_one=not cfg.use_pre_softmax)
        return RoutingConstraint(RoutingKind.CAPACITY, 0, k, capacity_factor=cfg.capacity_factor, top_k=k)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        cfg = self.config
        T = hidden_TD.shape[0]
        logits_TE = self.logits(hidden_TD)
        with_losses = self.training and torch.is_grad_enabled()

        aux_losses: dict[str, torch.Tensor] = {}
        if with_losses and cfg.z_loss_coeff > 0:
            aux_losses["z_loss"] = z_loss_func(logits_TE, cfg.z_loss_coeff)

        probs_TE, routing_map_TE = topk_routing_with_score_function(
            logits_TE, cfg.top_k, use_pre_softmax=cfg.use_pre_softmax, score_function="softmax"
        )
        assigned_before_drop = routing_map_TE.sum() if self.collect_metrics else None
        if cfg.capacity_factor is not None:
            # No padding to capacity (a dispatcher concern): the map stays "k at most".
            probs_TE, routing_map_TE = apply_router_token_dropping(
                probs_TE, routing_map_TE, router_topk=cfg.top_k, capacity_factor=cfg.capacity_factor,
                drop_policy=cfg.drop_policy, pad_to_capacity=False,
            )

        # As megatron-core: balance statistics from the full softmax and the undropped top-k.
        aux_map_TE, scores_TE = compute_routing_scores_for_aux_loss(logits_TE, cfg.top_k, "softmax")
        if with_losses and cfg.aux_loss_coeff > 0:
            aux_losses["load_balancing_loss"] = switch_load_balancing_loss_func(
                scores_TE, aux_map_TE.sum(0), T, cfg.top_k, cfg.num_experts, cfg.aux_loss_coeff
            )
        return self.output(probs_TE.float(), routing_map_TE, aux_losses, lambda: {
            "balance_loss": balance_metric(scores_TE, aux_map_TE.sum(0), cfg),
            "z_loss": z_loss_metric(logits_TE),
            "dropped_fraction": 1.0 - routing_map_TE.sum() / assigned_before_drop.clamp_min(1),
        })
