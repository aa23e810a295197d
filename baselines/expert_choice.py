"""Expert Choice routing: every expert picks its top-C tokens of each token group.

Reference:
    Zhou, Lei, Liu, Du, Huang, Zhao, Dai, Chen, Le, Laudon, "Mixture-of-Experts with Expert Choice
    Routing", NeurIPS 2022 (arXiv:2202.09368). The authors' code is Google's flaxformer
    (``flaxformer/architectures/moe/routing.py``, ``ExpertsChooseMaskedRouter``, which warns that the
    routing is not causal; ``moe_layers.py``, ``MoeLayer``, which cuts the tokens into groups, sets the
    capacity per group and has separate train and eval capacity factors; the router z-loss is
    ``routing.py``'s ``_router_z_loss``, the ST-MoE loss ``mean_t logsumexp(logits_t)^2``).

Options and how they relate to the reference. The group and capacity rules follow one of two references
(``reference``):

==================  =======================================  ==========================================
``reference``       ``"megatron"`` (default)                  ``"flaxformer"``
capacity per group  ``C = min(g, ceil((g * k / E) * (c / k)))`` ``C = max(round(c * g / E), 4)``, capped
                    (megatron-core's ``get_capacity``         at g (flaxformer ``moe_layers.MoeLayer``:
                    expression and operation order, as        ``int(round(capacity_factor *
                    everywhere in the suite)                  tokens_per_group / num_experts))``, then
                                                              ``max(., min_expert_capacity=4)``; Python's
                                                              round, half to even)
number of groups    the smallest n >= T / G that divides T    flaxformer's ``_num_groups`` (one replica):
                                                              the smallest n >= max(T // G, E) that
                                                              divides T and is a multiple of E (or T)
==================  =======================================  ==========================================

Why megatron's stays the default: the suite's other capacity routers use megatron-core's expression, and
the two agree wherever the comparisons run (one group per micro-batch, E divides g * c: the 185M runs,
g = 16384, E = 8, c = 1; the tiny runs, g = 512); flaxformer's group count always cuts a micro-batch
into at least E groups (its SPMD sharding puts groups on the expert axis), a different routing that the
papers' numbers were not measured with on this suite's hardware layout. ``reference=flaxformer`` runs
the authors' code's rules as they are.

1. ``group_size``: the experts choose among the tokens of a group. flaxformer reshapes the batch
   (batch-major, so consecutive tokens of a sequence) into groups of at most ``max_group_size`` tokens
   (its ``_num_groups``). Here ``None`` (default) is one group per micro-batch under ``megatron`` (the
   suite's earlier behaviour and what a plain port of the paper's formula does) and a ``max_group_size``
   of the whole micro-batch under ``flaxformer`` (which still makes E groups); ``"sequence"`` makes every
   sequence its own group (``megatron``), or sets ``max_group_size`` to the sequence length
   (``flaxformer``), so a token's routing no longer depends on the micro-batch size; an integer G is the
   largest group, the number of groups then chosen by the reference's rule (table above). The group size
   used is reported as the metric ``group_size`` (and ``num_groups``), for the efficiency table.
2. ``eval_capacity_factor`` and ``z_loss_coeff`` are flaxformer's ``eval_capacity_factor`` and
   ``router_z_loss``.

Shape legend: T tokens, D hidden size, E experts, N groups, G tokens per group (see :mod:`routers.base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import z_loss_func

from baselines._gate import GatedRouter, z_loss_metric
from routers.base import RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, require
from routers.metrics import routing_metrics
from routers.registry import register_router

#: ``group_size`` value that makes every sequence of the micro-batch its own group.
SEQUENCE_GROUPS = "sequence"
#: ``reference`` values: whose capacity and group-count rules (see the module docstring).
EC_REFERENCES = ("megatron", "flaxformer")
#: flaxformer ``MoeLayer.min_expert_capacity``'s default.
FLAXFORMER_MIN_CAPACITY = 4


@dataclass(frozen=True)
class ExpertChoiceConfig(RouterConfig):
    """Options of the Expert Choice router (the module docstring gives each option's reference)."""

    # The paper's c, the mean number of experts per token: each expert takes C tokens of every group of g
    # tokens, C = ceil(g * c / E) under reference="megatron". None means c = k, the compute of top-k routing,
    # as in the paper's comparisons.
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None  # c in eval mode; None uses capacity_factor
    # None (the whole micro-batch is one group), "sequence" (one group per sequence) or tokens per group.
    group_size: int | str | None = None
    z_loss_coeff: float = 0.0  # coefficient of the router z-loss coeff * mean_t logsumexp(logits_t)^2; 0: off
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
        is_count = isinstance(size, int) and not isinstance(size, bool) and size >= 1
        rule = f"None (the micro-batch), {SEQUENCE_GROUPS!r} or an integer >= 1"
        require(size is None or size == SEQUENCE_GROUPS or is_count, "group_size", size, rule)
        require(self.z_loss_coeff >= 0, "z_loss_coeff", self.z_loss_coeff, ">= 0")
        require(self.init_std > 0, "init_std", self.init_std, "> 0")

    @property
    def effective_capacity_factor(self) -> float:
        """c in training: ``capacity_factor``, or ``top_k`` when it is None."""
        return float(self.top_k) if self.capacity_factor is None else float(self.capacity_factor)

    @property
    def effective_eval_capacity_factor(self) -> float:
        """c in eval mode: ``eval_capacity_factor``, or the training c when it is None."""
        c = self.eval_capacity_factor
        return self.effective_capacity_factor if c is None else float(c)


def num_groups(num_tokens: int, group_size: int, reference: str = "megatron", num_experts: int = 1) -> int:
    """n, the number of groups of ``T / n`` tokens (each at most ``group_size``) the T ``num_tokens`` are cut
    into, by the ``reference``'s rule (the module docstring's table; flaxformer's with one expert replica).
    ``ValueError`` when flaxformer's finds none (T < E), as flaxformer raises."""
    if reference == "flaxformer":
        n = max(num_tokens // group_size, num_experts)
        while n < num_tokens and not (num_tokens % n == 0 and n % num_experts == 0):
            n += 1
        if num_tokens % n:
            raise ValueError(
                f"flaxformer groups: {num_tokens} tokens cannot be cut into a multiple of {num_experts} groups"
            )
        return n
    n = max(1, math.ceil(num_tokens / group_size))
    while num_tokens % n:
        n += 1
    return n


def group_capacity(group_size: int, capacity_factor: float, num_experts: int, top_k: int, reference: str) -> int:
    """C, the tokens every expert takes from a group of g ``group_size`` tokens at capacity factor c, by the
    ``reference``'s rule (the module docstring's table; under megatron's, c / k * k cancels up to float
    rounding). The cap at g, which flaxformer lacks, keeps the top-C defined."""
    if reference == "flaxformer":
        return min(group_size, max(int(round(capacity_factor * group_size / num_experts)), FLAXFORMER_MIN_CAPACITY))
    return RoutingConstraint(
        RoutingKind.EXPERT_CHOICE, 0, num_experts, capacity_factor=capacity_factor / top_k, top_k=top_k
    ).capacity(group_size, num_experts)


def group_tokens(
    seq_shape: tuple[int, int], group_size: int | str | None, reference: str = "megatron", num_experts: int = 1,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``[N, G]`` long: row n holds the (megatron-order, ``t = s * B + b``) indices of the tokens of group n,
    batch-major (consecutive positions of one sequence together), grouped by the reference's rule
    (:func:`num_groups`). Built on ``device`` directly: a host-to-device copy would synchronise."""
    S, B = seq_shape
    T = S * B
    # Batch-major order: sequence b's tokens s = 0..S-1, then sequence b + 1's (flaxformer's reshape).
    batch_major_T = torch.arange(T, device=device).view(S, B).t().reshape(-1)
    if group_size is None and reference == "megatron":
        return batch_major_T[None, :]
    size = T if group_size is None else S if group_size == SEQUENCE_GROUPS else int(group_size)
    return batch_major_T.view(num_groups(T, size, reference, num_experts), -1)


@dataclass(frozen=True)
class ExpertChoiceConstraint(RoutingConstraint):
    """EXPERT_CHOICE with the capacity of the router's group and capacity rules.

    ``capacity(T, E)`` is the tokens each expert takes from a micro-batch of T tokens: N groups times the
    per-group C of the reference (:func:`group_capacity`), with the groups of ``group_size``
    (``"sequence"`` is taken as one sequence of T tokens: the constraint does not see the sequence length).
    ``expert_capacity_factor`` is c itself (``capacity_factor`` holds c / k, megatron's form).
    """

    group_size: int | str | None = None
    reference: str = "megatron"
    expert_capacity_factor: float = 1.0

    def capacity(self, num_tokens: int, num_experts: int) -> int:
        N, G = group_tokens((num_tokens, 1), self.group_size, self.reference, num_experts).shape
        return N * group_capacity(G, self.expert_capacity_factor, num_experts, self.top_k, self.reference)


@register_router("expert_choice")
class ExpertChoiceRouter(GatedRouter):
    """Expert Choice routing (Zhou et al. 2022), implemented as published, per token group.

    ``scores = softmax(W h)`` over the experts; within every group of g tokens each expert takes the C tokens
    with the highest score for it (:func:`group_capacity`, c the training or eval capacity factor); ``probs``
    are the scores on that map (not renormalised, as in the paper's gating matrix). A token may be taken by 0
    to E experts. Every expert is exactly full in every group, so there is no load-balancing loss (a z-loss is
    optional).

    Causal leakage, stated plainly: the experts choose among all tokens of a group, so in a causal decoder
    a token's routing depends on the other tokens of its group, later tokens of its own sequence included
    (the reference code warns of exactly this). With the default group (the micro-batch) it also depends
    on the other sequences of the batch and on the micro-batch size; ``group_size="sequence"`` confines it
    to the token's own sequence. It is implemented as published and its results are measured and reported
    as such, not corrected.

    The declared constraint is an :class:`ExpertChoiceConstraint`. Aux loss: ``z_loss`` (when enabled).
    Metrics: ``capacity`` (C per group), ``group_size`` (g), ``num_groups`` (N) and ``z_loss`` (unscaled).
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
        """C, the tokens each expert takes from a group of ``num_tokens`` tokens, with the capacity factor of
        ``training`` (default: the module's mode)."""
        cfg = self.config
        training = self.training if training is None else training
        c = cfg.effective_capacity_factor if training else cfg.effective_eval_capacity_factor
        return group_capacity(num_tokens, c, cfg.num_experts, cfg.top_k, cfg.reference)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        cfg = self.config
        T = hidden_TD.shape[0]
        logits_TE = self.logits(hidden_TD)
        scores_TE = torch.softmax(logits_TE, dim=-1)
        seq = (T, 1) if seq_shape is None else seq_shape
        groups_NG = group_tokens(seq, cfg.group_size, cfg.reference, cfg.num_experts, hidden_TD.device)
        N, G = groups_NG.shape
        capacity = self.capacity(G)
        # Top-C along each group's token axis: expert e's column keeps its C best tokens of the group
        # (topk breaks ties, so every expert takes exactly C per group).
        chosen_NCE = torch.topk(scores_TE.detach()[groups_NG], k=capacity, dim=1).indices
        token_NCE = torch.gather(groups_NG[:, :, None].expand(N, G, cfg.num_experts), 1, chosen_NCE)
        routing_map_TE = torch.zeros_like(scores_TE, dtype=torch.bool)
        routing_map_TE.scatter_(0, token_NCE.reshape(N * capacity, cfg.num_experts), True)
        probs_TE = scores_TE * routing_map_TE

        aux_losses: dict[str, torch.Tensor] = {}
        if self.training and torch.is_grad_enabled() and cfg.z_loss_coeff > 0:
            aux_losses["z_loss"] = z_loss_func(logits_TE, cfg.z_loss_coeff)

        metrics: dict[str, torch.Tensor] = {}
        if self.collect_metrics:
            metrics = routing_metrics(probs_TE, routing_map_TE)
            for key, value in (("capacity", capacity), ("group_size", G), ("num_groups", N)):
                metrics[key] = torch.tensor(float(value), device=probs_TE.device)
            metrics["z_loss"] = z_loss_metric(logits_TE)
        return RouterOutput(probs_TE, routing_map_TE, aux_losses, metrics)
