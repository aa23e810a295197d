"""Switch / dMoE: token-choice top-k routing with the load-balancing loss (megatron-core's TopKRouter).

References:
    Fedus, Zoph, Shazeer, "Switch Transformers: Scaling to Trillion Parameter Models with Simple and
    Efficient Sparsity", JMLR 2022 (arXiv:2101.03961): top-1 routing, the load-balancing loss
    ``alpha * E * sum_i f_i P_i``, expert capacity with token dropping.
    Gale, Narayanan, Young, Zaharia, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts",
    MLSys 2023 (arXiv:2211.15841): dMoE, the same router made dropless.
    Zoph et al., "ST-MoE" (arXiv:2202.08906): the router z-loss.
    Code: megatron-core 0.16.1 ``megatron/core/transformer/moe/router.py`` (``TopKRouter``) and
    ``moe_utils.py``, whose functions this router calls so the maths is megatron-core's own.

Shape legend: T tokens, D hidden size, E experts (see :mod:`routers.base`).
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

from baselines._gate import check_init_std, gate_logits, make_gate_weight
from routers.base import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind
from routers.metrics import routing_metrics
from routers.registry import register_router

DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class SwitchConfig(RouterConfig):
    """Options of the Switch / dMoE router; each maps to one megatron-core ``TransformerConfig`` field.

    Args:
        aux_loss_coeff: alpha of the load-balancing loss (``moe_aux_loss_coeff``); 0 turns it off.
        z_loss_coeff: coefficient of the router z-loss (``moe_z_loss_coeff``); 0 (default) turns it off.
        pre_softmax: softmax before the top-k (``moe_router_pre_softmax``): the k weights are the full
            softmax's values, not renormalised. ``None`` follows megatron-core: True for k = 1 (0.16.1
            requires it: a softmax over one selected logit has zero gradient), its default False for k > 1
            (softmax over the k selected logits, so the weights sum to one). ReMoE's dMoE launch scripts pass
            ``--moe-router-pre-softmax`` whatever k (``scripts/train_llama_182m_moe.sh``), so runs compared
            with ReMoE's numbers at k > 1 (the k sweeps) set True.
        capacity_factor: ``None`` (default) is dropless (dMoE); a value c > 0 caps every expert at
            ``ceil((T * k / E) * c)`` tokens and drops the rest (``moe_expert_capacity_factor``).
        drop_policy: which tokens an over-full expert keeps: "probs" (highest weight) or "position"
            (earliest) (``moe_token_drop_policy``).
        init_std: std of the normal initialisation of the gate weight.
    """

    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    pre_softmax: bool | None = None
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    init_std: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.aux_loss_coeff >= 0:
            raise ValueError(f"aux_loss_coeff must be >= 0, got {self.aux_loss_coeff}")
        if not self.z_loss_coeff >= 0:
            raise ValueError(f"z_loss_coeff must be >= 0, got {self.z_loss_coeff}")
        if self.pre_softmax is False and self.top_k == 1:
            raise ValueError(
                "pre_softmax must be True or None when top_k == 1 (megatron-core 0.16.1 requires softmax "
                "before a top-1 selection: a softmax over one logit has zero gradient)"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be None (dropless) or > 0, got {self.capacity_factor}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {self.drop_policy!r}")
        check_init_std(self.init_std)

    @property
    def use_pre_softmax(self) -> bool:
        """The effective ``moe_router_pre_softmax`` (see ``pre_softmax``)."""
        return self.top_k == 1 if self.pre_softmax is None else self.pre_softmax


@register_router("switch")
class SwitchRouter(Router):
    """Token-choice top-k routing: Switch Transformer (k = 1) and dMoE, exactly megatron-core's TopKRouter.

    logits = W h (float32, no bias, W ~ N(0, init_std^2)); probs and routing_map from megatron-core's
    ``topk_routing_with_score_function`` (softmax score function); optional capacity dropping with
    ``apply_router_token_dropping``; in training with grad enabled, the load-balancing loss
    ``alpha * E * sum_i f_i P_i`` (f_i: share of the k*T assignments going to expert i before dropping,
    P_i: mean softmax probability of expert i) from ``switch_load_balancing_loss_func`` and, when
    enabled, the z-loss ``coeff * mean_t logsumexp(logits_t)^2`` from ``z_loss_func``.

    Differences from megatron-core's router, by design of the shared interface: the losses are returned
    as named scalars (the megatron adapter attaches them with ``MoEAuxLossAutoScaler`` and logs them)
    instead of being attached to ``probs``/``logits`` here, and the token counts are those of the local
    micro-batch (megatron-core all-reduces them over the tensor/context-parallel group, a no-op when that
    group has one rank; its z-loss coefficient is likewise divided by that group's size).
    """

    Config = SwitchConfig
    # ReMoE's dMoE scripts take the softmax before the top-k at every k (``--moe-router-pre-softmax``); the
    # 185M runs and the k-sweeps derived from them follow that (at k = 1 it is what megatron requires anyway).
    recipe_overrides = {"185m": ("router.options.pre_softmax=true",)}

    def __init__(self, config: SwitchConfig) -> None:
        super().__init__(config)
        self.weight = make_gate_weight(config.num_experts, config.hidden_size, config.init_std)

    @property
    def constraint(self) -> RoutingConstraint:
        cfg = self.config
        if cfg.capacity_factor is None:
            # Dropless: exactly k experts; the post-top-k softmax makes the k weights sum to one.
            return RoutingConstraint(
                RoutingKind.EXACT_K, cfg.top_k, cfg.top_k, top_k=cfg.top_k, probs_sum_to_one=not cfg.use_pre_softmax
            )
        return RoutingConstraint(
            RoutingKind.CAPACITY, 0, cfg.top_k, capacity_factor=cfg.capacity_factor, top_k=cfg.top_k
        )

    def route(
        self,
        hidden_TD: torch.Tensor,
        token_ids_T: torch.Tensor | None = None,
        seq_shape: tuple[int, int] | None = None,
    ) -> RouterOutput:
        """Route each token to its top-k experts.

        Args:
            hidden_TD: ``[T, D]`` hidden states.
            token_ids_T: unused.
            seq_shape: unused (the per-sequence aux loss variant is not offered).

        Returns:
            :class:`RouterOutput` with ``load_balancing_loss`` (and ``z_loss``) in training mode with grad
            enabled, and the metrics ``balance_loss`` / ``z_loss`` (unscaled) and ``dropped_fraction``.
        """
        cfg = self.config
        T = hidden_TD.shape[0]
        logits_TE = gate_logits(hidden_TD, self.weight)
        with_losses = self.training and torch.is_grad_enabled()

        aux_losses: dict[str, torch.Tensor] = {}
        if with_losses and cfg.z_loss_coeff > 0:
            aux_losses["z_loss"] = z_loss_func(logits_TE, cfg.z_loss_coeff)

        probs_TE, routing_map_TE = topk_routing_with_score_function(
            logits_TE, cfg.top_k, use_pre_softmax=cfg.use_pre_softmax, score_function="softmax"
        )
        assigned_before_drop = routing_map_TE.sum() if self.collect_metrics else None
        if cfg.capacity_factor is not None:
            probs_TE, routing_map_TE = apply_router_token_dropping(
                probs_TE,
                routing_map_TE,
                router_topk=cfg.top_k,
                capacity_factor=cfg.capacity_factor,
                drop_policy=cfg.drop_policy,
                pad_to_capacity=False,  # padding is a dispatcher concern; the map stays "k at most"
            )

        # megatron-core computes the balance statistics from the full softmax and the undropped top-k.
        aux_map_TE, scores_TE = compute_routing_scores_for_aux_loss(logits_TE, cfg.top_k, "softmax")
        if with_losses and cfg.aux_loss_coeff > 0:
            aux_losses["load_balancing_loss"] = switch_load_balancing_loss_func(
                probs=scores_TE,
                tokens_per_expert=aux_map_TE.sum(0),
                total_num_tokens=T,
                topk=cfg.top_k,
                num_experts=cfg.num_experts,
                moe_aux_loss_coeff=cfg.aux_loss_coeff,
            )

        if not self.collect_metrics:
            return RouterOutput(probs_TE.float(), routing_map_TE, aux_losses, {})
        metrics = routing_metrics(probs_TE, routing_map_TE)
        with torch.no_grad():
            metrics["balance_loss"] = switch_load_balancing_loss_func(
                scores_TE.detach(), aux_map_TE.sum(0), T, cfg.top_k, cfg.num_experts, 1.0
            )
            metrics["z_loss"] = torch.logsumexp(logits_TE.detach(), -1).square().mean()
            metrics["dropped_fraction"] = 1.0 - routing_map_TE.sum() / assigned_before_drop.clamp_min(1)
        return RouterOutput(probs_TE.float(), routing_map_TE, aux_losses, metrics)
