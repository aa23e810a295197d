"""Expert Choice routing: every expert picks its top-C tokens of each token group.

Reference:
    Zhou et al., "Mixture-of-Experts with Expert Choice Routing", NeurIPS 2022 (arXiv:2202.09368). Authors' code:
    flaxformer ``routing.py`` (``ExpertsChooseMaskedRouter``, which warns it is not causal; ``_router_z_loss``)
    and ``moe_layers.py`` (``MoeLayer``: token groups, per-group capacity, train and eval capacity factors).

Group and capacity rules (``reference``):

* ``"megatron"`` (default): ``C = min(g, ceil((g * k / E) * (c / k)))`` (megatron-core's ``get_capacity``, same
  operation order); groups: the smallest n >= T / G that divides T.
* ``"flaxformer"``: ``C = max(round(c * g / E), 4)`` capped at g (``MoeLayer``; round half to even); groups:
  ``_num_groups`` (one replica), the smallest n >= max(T // G, E) dividing T and a multiple of E (or T).

Megatron's is the default: the suite's other capacity routers use it, the capacities agree where the comparisons
run (E divides g * c), and flaxformer's at least E groups (its SPMD sharding) are a different routing.

A group's tokens are taken batch-major, as flaxformer reshapes; ``group_size="sequence"`` makes routing
independent of the micro-batch size, an integer (flaxformer's ``max_group_size``) bounds a group.

Shape legend: T tokens, D hidden size, E experts, N groups, G tokens per group (see :mod:`routers.base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import z_loss_func

from baselines._gate import GatedRouter, z_loss_metric
from routers import RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, register_router
from routers.base import is_int, require

#: ``group_size`` value that makes every sequence of the micro-batch its own group.
SEQUENCE_GROUPS = "sequence"
EC_REFERENCES = ("megatron", "flaxformer")
#: flaxformer ``MoeLayer.min_expert_capacity``'s default.
FLAXFORMER_MIN_CAPACITY = 4


@dataclass(frozen=True)
class ExpertChoiceConfig(RouterConfig):
    """Options of the Expert Choice router (``reference``'s rules: module docstring); ``eval_capacity_factor`` and
    ``z_loss_coeff`` are flaxformer's ``eval_capacity_factor`` and ``router_z_loss``."""

    # c, mean experts per token; None: c = k (top-k's compute, as the paper's comparisons)
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None  # c in eval mode; None uses capacity_factor
    group_size: int | str | None = None  # None (the micro-batch), "sequence" or tokens per group
    z_loss_coeff: float = 0.0  # coeff of the router z-loss coeff * mean_t logsumexp(logits_t)^2; 0: off
    init_std: float = 0.01
    reference: str = "megatron"  # whose capacity and group-count rules: "megatron" or "flaxformer"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.reference in EC_REFERENCES, "reference", self.reference, f"one of {EC_REFERENCES}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            rule = f"None (= top_k) or in (0, num_experts={self.num_experts}]"
            require(value is None or 0 < value <= self.num_experts, name, value, rule)
        size = self.group_size
        rule = f"None (the micro-batch), {SEQUENCE_GROUPS!r} or an integer >= 1"
        require(size is None or size == SEQUENCE_GROUPS or (is_int(size) and size >= 1), "group_size", size, rule)
        require(self.z_loss_coeff >= 0, "z_loss_coeff", self.z_loss_coeff, ">= 0")
        require(self.init_std > 0, "init_std", self.init_std, "> 0")

    @property
    def effective_capacity_factor(self) -> float:
        """c in training: ``capacity_factor``, or ``top_k`` when it is None."""
        return float(self.top_k) if self.capacity_factor is None else float(self.capacity_factor)


def num_groups(num_tokens: int, group_size: int, reference: str = "megatron", num_experts: int = 1) -> int:
    """n, the number of groups (of ``T / n <= group_size`` tokens) by the ``reference``'s rule (module docstring);
    ``ValueError`` when flaxformer's finds none (T < E), as flaxformer."""
    flax = reference == "flaxformer"
    n = max(num_tokens // group_size, num_experts) if flax else max(1, math.ceil(num_tokens / group_size))
    while n < num_tokens and (num_tokens % n or (flax and n % num_experts)):
        n += 1
    if num_tokens % n:  # flaxformer's only: megatron's n reaches T at worst
        raise ValueError(
            f"flaxformer groups: {num_tokens} tokens cannot be cut into a multiple of {num_experts} groups")
    return n


def group_capacity(group_size: int, capacity_factor: float, num_experts: int, top_k: int, reference: str) -> int:
    """C, the tokens every expert takes from a group of g, by the ``reference``'s rule (module docstring); capped
    at g (flaxformer is not) so the top-C is defined."""
    if reference == "flaxformer":
        return min(group_size, max(int(round(capacity_factor * group_size / num_experts)), FLAXFORMER_MIN_CAPACITY))
    return RoutingConstraint(
        RoutingKind.EXPERT_CHOICE, 0, num_experts, capacity_factor=capacity_factor / top_k, top_k=top_k
    ).capacity(group_size, num_experts)


def group_tokens(
    seq_shape: tuple[int, int], group_size: int | str | None, reference: str = "megatron", num_experts: int = 1,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``[N, G]`` long: row n holds group n's token indices (``t = s * B + b``), batch-major, by :func:`num_groups`;
    built on ``device`` (a host-to-device copy would synchronise)."""
    S, B = seq_shape
    T = S * B
    # Sequence b's tokens s = 0..S-1, then sequence b + 1's (flaxformer's reshape).
    batch_major_T = torch.arange(T, device=device).view(S, B).t().reshape(-1)
    if group_size is None and reference == "megatron":
        return batch_major_T[None, :]
    size = T if group_size is None else S if group_size == SEQUENCE_GROUPS else int(group_size)
    return batch_major_T.view(num_groups(T, size, reference, num_experts), -1)


@dataclass(frozen=True)
class ExpertChoiceConstraint(RoutingConstraint):
    """EXPERT_CHOICE by the router's rules: ``capacity(T, E)`` = N groups times C (``"sequence"``: one of T tokens);
    ``expert_capacity_factor`` is c (``capacity_factor``: c / k)."""

    group_size: int | str | None = None
    reference: str = "megatron"
    expert_capacity_factor: float = 1.0

    def capacity(self, num_tokens: int, num_experts: int) -> int:
        N, G = group_tokens((num_tokens, 1), self.group_size, self.reference, num_experts).shape
        return N * group_capacity(G, self.expert_capacity_factor, num_experts, self.top_k, self.reference)


@register_router("expert_choice")
class ExpertChoiceRouter(GatedRouter):
    """Expert Choice routing (Zhou et al. 2022), as published, per token group: ``scores = softmax(W h)``; each
    expert takes its C highest-scoring tokens of every group; ``probs`` are the scores on that map, not
    renormalised (the paper's gating matrix). 0 to E experts per token; every expert exactly full, so no balancing
    loss. Aux loss: ``z_loss``. Metrics: ``capacity`` (C), ``group_size``, ``num_groups``, ``z_loss``.

    Causal leakage, as published: a token's routing depends on its group's later tokens (the reference warns of
    it); ``group_size="sequence"`` confines it to its sequence.
    """

    Config = ExpertChoiceConfig

    @property
    def constraint(self) -> RoutingConstraint:
        cfg = self.config
        c = cfg.effective_capacity_factor
        return ExpertChoiceConstraint(
            RoutingKind.EXPERT_CHOICE, 0, cfg.num_experts, capacity_factor=c / cfg.top_k, top_k=cfg.top_k,
            group_size=cfg.group_size, reference=cfg.reference, expert_capacity_factor=c,
        )

    def capacity(self, num_tokens: int, training: bool | None = None) -> int:
        """C for a group of ``num_tokens`` tokens, at the capacity factor of ``training`` (default: the mode)."""
        cfg = self.config
        training = self.training if training is None else training
        c_eval = cfg.eval_capacity_factor
        c = cfg.effective_capacity_factor if training or c_eval is None else float(c_eval)
        return group_capacity(num_tokens, c, cfg.num_experts, cfg.top_k, cfg.reference)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        cfg = self.config
        T = hidden_TD.shape[0]
        logits_TE = self.logits(hidden_TD)
        scores_TE = torch.softmax(logits_TE, dim=-1)
        groups_NG = group_tokens(seq_shape or (T, 1), cfg.group_size, cfg.reference, cfg.num_experts, hidden_TD.device)
        N, G = groups_NG.shape
        capacity = self.capacity(G)
        # Top-C along each group's token axis (topk breaks ties: every expert takes exactly C per group).
        chosen_NCE = torch.topk(scores_TE.detach()[groups_NG], k=capacity, dim=1).indices
        token_NCE = torch.gather(groups_NG[:, :, None].expand(N, G, cfg.num_experts), 1, chosen_NCE)
        routing_map_TE = torch.zeros_like(scores_TE, dtype=torch.bool)
        routing_map_TE.scatter_(0, token_NCE.reshape(N * capacity, cfg.num_experts), True)
        probs_TE = scores_TE * routing_map_TE

        aux_losses: dict[str, torch.Tensor] = {}
        if self.training and torch.is_grad_enabled() and cfg.z_loss_coeff > 0:
            aux_losses["z_loss"] = z_loss_func(logits_TE, cfg.z_loss_coeff)
        return self.output(probs_TE, routing_map_TE, aux_losses, lambda: {
            **{key: torch.tensor(float(value), device=probs_TE.device)
               for key, value in (("capacity", capacity), ("group_size", G), ("num_groups", N))},
            "z_loss": z_loss_metric(logits_TE),
        })
