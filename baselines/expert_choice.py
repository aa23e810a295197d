"""Expert Choice routing: every expert picks its top-C tokens of the batch.

Reference:
    Zhou, Lei, Liu, Du, Huang, Zhao, Dai, Chen, Le, Laudon, "Mixture-of-Experts with Expert Choice
    Routing", NeurIPS 2022 (arXiv:2202.09368). The authors' code is in Google's flaxformer / t5x MoE
    routing (``ExpertsChooseMaskedRouter``), which warns that the routing is not causal.

Shape legend: T tokens, D hidden size, E experts (see :mod:`routers.base`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baselines._gate import check_init_std, gate_logits, make_gate_weight
from routers.base import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind
from routers.metrics import routing_metrics
from routers.registry import register_router


@dataclass(frozen=True)
class ExpertChoiceConfig(RouterConfig):
    """Options of the Expert Choice router.

    Args:
        capacity_factor: the paper's c, the mean number of experts per token: each expert takes
            ``C = ceil((T * k / E) * (c / k)) = ceil(T * c / E)`` tokens (at most T; megatron-core's capacity expression). ``None`` (default) means c = k, the compute of
            top-k routing, as in the paper's comparisons.
        init_std: std of the normal initialisation of the gate weight.
    """

    capacity_factor: float | None = None
    init_std: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity_factor is not None and not 0 < self.capacity_factor <= self.num_experts:
            raise ValueError(
                f"capacity_factor must be None (= top_k) or in (0, num_experts={self.num_experts}], "
                f"got {self.capacity_factor}"
            )
        check_init_std(self.init_std)

    @property
    def effective_capacity_factor(self) -> float:
        """c: ``capacity_factor``, or ``top_k`` when it is None."""
        return float(self.top_k) if self.capacity_factor is None else float(self.capacity_factor)


@register_router("expert_choice")
class ExpertChoiceRouter(Router):
    """Expert Choice routing (Zhou et al. 2022), implemented as published.

    ``scores = softmax(W h)`` over the experts (float32, no bias, W ~ N(0, init_std^2)); each expert
    takes the C tokens of the micro-batch with the highest score for it, ``C = ceil(T * c / E)``;
    ``probs`` are the scores on that map (not renormalised, as in the paper's gating matrix). A token
    may be taken by 0 to E experts. Every expert is exactly full, so there is no aux loss.

    Causal leakage, stated plainly: the experts choose among all T tokens of the micro-batch, so in a
    causal decoder a token's routing depends on the other tokens of the batch, later tokens of its own
    sequence included (the reference code warns of exactly this). At evaluation the routing of a token
    likewise depends on what else is in the batch. It is implemented as published and its results are
    measured and reported as such, not corrected.

    The declared constraint is EXPERT_CHOICE with ``top_k = k`` and ``capacity_factor = c / k``, so
    that ``RoutingConstraint.capacity(T, E) = ceil(T * k * (c/k) / E)`` is C; ``route`` takes C from that
    same formula.
    """

    Config = ExpertChoiceConfig

    def __init__(self, config: ExpertChoiceConfig) -> None:
        super().__init__(config)
        self.weight = make_gate_weight(config.num_experts, config.hidden_size, config.init_std)

    @property
    def constraint(self) -> RoutingConstraint:
        cfg = self.config
        return RoutingConstraint(
            RoutingKind.EXPERT_CHOICE,
            0,
            cfg.num_experts,
            capacity_factor=cfg.effective_capacity_factor / cfg.top_k,
            top_k=cfg.top_k,
        )

    def capacity(self, num_tokens: int) -> int:
        """C, the tokens each expert takes from a micro-batch of ``num_tokens`` tokens."""
        return self.constraint.capacity(num_tokens, self.num_experts)

    def route(
        self,
        hidden_TD: torch.Tensor,
        token_ids_T: torch.Tensor | None = None,
        seq_shape: tuple[int, int] | None = None,
    ) -> RouterOutput:
        """Let each expert choose its top-C tokens.

        Args:
            hidden_TD: ``[T, D]`` hidden states (all tokens of the micro-batch compete).
            token_ids_T: unused.
            seq_shape: unused (the choice is over the whole micro-batch, across sequences).

        Returns:
            :class:`RouterOutput` with no aux loss and the extra metric ``capacity`` (C).
        """
        T = hidden_TD.shape[0]
        scores_TE = torch.softmax(gate_logits(hidden_TD, self.weight), dim=-1)
        capacity = self.capacity(T)
        # Top-C along the token axis: expert e's column keeps its C best tokens (topk breaks ties, so
        # every expert takes exactly C).
        chosen_CE = torch.topk(scores_TE.detach(), k=capacity, dim=0).indices
        routing_map_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(0, chosen_CE, True)
        probs_TE = scores_TE * routing_map_TE

        metrics = routing_metrics(probs_TE, routing_map_TE)
        metrics["capacity"] = torch.tensor(float(capacity), device=probs_TE.device)
        return RouterOutput(probs_TE, routing_map_TE, {}, metrics)
