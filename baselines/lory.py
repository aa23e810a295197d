"""Lory: causal segment routing for merging experts in parameter space.

Reference:
    Zhong, Xia, Chen, Lewis, "Lory: Fully Differentiable Mixture-of-Experts for Autoregressive Language Model
    Pre-training", COLM 2024 (arXiv:2405.03133). No public code; from Sec. 3.1 and Appendix A (Algorithm 1).

The layer merging the experts' parameters is :mod:`baselines.lory_layer`; the paper's similarity batching
(Sec. 3.2) is :mod:`repro.data.similarity`, turned on by ``recipe_overrides``.

The dense start (``dense_fraction``; Sec. 4.1, Appendix G.3: "crucial"): the first ``config.dense_steps`` steps
train one dense FFN, E tied experts in the merge layer, so at the switch every expert *is* it, optimizer state
included, with nothing outside the state dict (the phase follows ``step``: any resume is exact). W_r has
``requires_grad`` off meanwhile: the CPU AdamW skips it; megatron's GPU optimizer takes zero-gradient steps (weight
decay only; Adam's bias correction counts them). Shape suffixes: :mod:`routers.base`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from baselines._gate import GatedRouter
from routers import RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, register_router
from routers.base import require

FIRST_SEGMENT_GRADS = ("none", "router")


@dataclass(frozen=True)
class LoryConfig(RouterConfig):
    """Options of the Lory router (the dense start: module docstring)."""

    segment_len: int = 256  # tokens per segment (paper: 256); a sequence's last segment may be shorter
    first_segment_grad: str = "none"  # "none" (paper) | "router" (only the mean detached; W_r learns)
    init_std: float = 0.01
    dense_fraction: float = 0.05  # share of the run's steps trained dense (paper: 0.05; 0: off)
    schedule_steps: int | None = None  # the run's schedule.steps (set by the run config); None: no dense phase

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.segment_len >= 1, "segment_len", self.segment_len, ">= 1")
        grads = FIRST_SEGMENT_GRADS
        require(self.first_segment_grad in grads, "first_segment_grad", self.first_segment_grad, f"one of {grads}")
        require(self.init_std > 0, "init_std", self.init_std, "> 0")
        require(0 <= self.dense_fraction < 1, "dense_fraction", self.dense_fraction, "in [0, 1)")
        steps = self.schedule_steps
        require(steps is None or steps >= 1, "schedule_steps", steps, "None or >= 1")

    @property
    def dense_steps(self) -> int:
        """Steps trained dense: ``round(dense_fraction * schedule_steps)``, 0 without ``schedule_steps``."""
        return 0 if self.schedule_steps is None else round(self.dense_fraction * self.schedule_steps)


def segment_means(hidden_TD: torch.Tensor, seq_shape: tuple[int, int] | None, segment_len: int) -> torch.Tensor:
    """``[B, G, D]`` float32 mean hidden state per segment (``seq_shape`` None: one sequence)."""
    T, D = hidden_TD.shape
    S, B = (T, 1) if seq_shape is None else seq_shape
    G = math.ceil(S / segment_len)
    hidden_SBD = hidden_TD.float().reshape(S, B, D)
    pad = G * segment_len - S
    if pad:  # zero-pad the last segment (a copy only then); its mean divides by its true length
        hidden_SBD = torch.cat([hidden_SBD, hidden_SBD.new_zeros(pad, B, D)], dim=0)
    sums_GBD = hidden_SBD.view(G, segment_len, B, D).sum(dim=1)
    counts_G = torch.full((G,), float(segment_len), device=hidden_TD.device)
    counts_G[-1] = S - (G - 1) * segment_len
    return (sums_GBD / counts_G[:, None, None]).permute(1, 0, 2)


def _sync_phase_after_load(module: LoryRouter, _incompatible_keys) -> None:
    """``load_state_dict`` post-hook: the dense phase follows the loaded ``step`` buffer."""
    module.dense_phase = int(module.step) < module.config.dense_steps


@register_router("lory")
class LoryRouter(GatedRouter):
    """Lory's causal segment routing (Zhong et al. 2024): :meth:`segment_weights` as ``probs [T, E]`` for every
    token of a segment; ``routing_map`` all True (MERGE); no aux loss. Metric: ``num_segments`` (G)."""

    Config = LoryConfig
    merges_experts = True
    # Similarity batching (Sec. 3.2); tiny's 128-token sequences need 32-token segments to have several each.
    recipe_overrides = {
        "tiny": ("router.options.segment_len=32", "data.similarity_batching=true"),
        "185m": ("data.similarity_batching=true",),
    }

    @classmethod
    def moe_layer_class(cls) -> type:
        from baselines.lory_layer import LoryMoELayer

        return LoryMoELayer

    def __init__(self, config: LoryConfig) -> None:
        super().__init__(config)
        # step < config.dense_steps, kept on the host (no sync per forward): set by set_step and on load_state_dict.
        self.dense_phase = config.dense_steps > 0
        self.register_load_state_dict_post_hook(_sync_phase_after_load)

    def set_step(self, step: int) -> None:
        """Set the step and the dense phase, during which W_r takes no gradient (module docstring)."""
        super().set_step(step)
        self.dense_phase = int(step) < self.config.dense_steps
        if self.config.dense_steps > 0:
            self.weight.requires_grad_(not self.dense_phase)

    @property
    def constraint(self) -> RoutingConstraint:
        E = self.num_experts
        return RoutingConstraint(RoutingKind.MERGE, E, E, top_k=self.top_k, probs_sum_to_one=True)

    def segment_weights(self, hidden_TD: torch.Tensor, seq_shape: tuple[int, int] | None = None) -> torch.Tensor:
        """``[B, G, E]`` float32 expert weights per segment: ``softmax(W_r mean(segment g-1))`` for g >= 1; for
        g = 0 ``stopgrad(softmax(W_r mean(segment 0)))`` (default) or ``softmax(W_r stopgrad(mean(segment 0)))``
        (``"router"``: W_r trains on segment 0, whose weights then see its own later tokens)."""
        means_BGD = segment_means(hidden_TD, seq_shape, self.config.segment_len)
        # Segment g reads segment g-1 (causal); the first reads itself, detached.
        route_on_BGD = torch.cat([means_BGD[:, :1].detach(), means_BGD[:, :-1]], dim=1)
        weights_BGE = torch.softmax(self.logits(route_on_BGD), dim=-1)
        if self.config.first_segment_grad == "none":
            # Algorithm 1 of the paper: e[:, 0] = stop_grad(e_first).
            weights_BGE = torch.cat([weights_BGE[:, :1].detach(), weights_BGE[:, 1:]], dim=1)
        return weights_BGE

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        T = hidden_TD.shape[0]
        S, B = (T, 1) if seq_shape is None else seq_shape
        weights_BGE = self.segment_weights(hidden_TD, seq_shape)
        seg_S = torch.arange(S, device=hidden_TD.device) // self.config.segment_len
        # [B, S, E] -> [S, B, E] -> [T, E] in megatron-core's token order.
        probs_TE = weights_BGE[:, seg_S].transpose(0, 1).reshape(T, self.num_experts)
        routing_map_TE = torch.ones(T, self.num_experts, dtype=torch.bool, device=hidden_TD.device)
        return self.output(probs_TE, routing_map_TE, extra_metrics=lambda: {
            "num_segments": torch.tensor(float(weights_BGE.shape[1]), device=hidden_TD.device)
        })
