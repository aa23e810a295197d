"""Lory: causal segment routing for merging experts in parameter space.

Reference:
    Zhong, Xia, Chen, Lewis, "Lory: Fully Differentiable Mixture-of-Experts for Autoregressive Language
    Model Pre-training", COLM 2024 (arXiv:2405.03133). No public code; written from the paper
    (Sec. 3.1 and Appendix A, Algorithm 1).

Only the router and the segment logic live here: the layer that merges the experts' parameters per
segment with these weights (and runs the merged FFN on the segment) is :mod:`baselines.lory_layer`, which the
model builder takes from :meth:`LoryRouter.moe_layer_class`. The paper's second technique, similarity-based
data batching (Sec. 3.2, Appendix C), is a data-pipeline option (:mod:`repro.data.similarity`) that Lory's
experiments turn on (``recipe_overrides``).

The first segment (a switchable default, ``first_segment_grad``):
    Segment 0 has no previous segment, so it is routed on the mean of its own hidden states. The paper
    (Sec. 3.1: "to prevent information leakage, we implement a stop-gradient operation on R(h_1)";
    Algorithm 1: ``e[:, 0] = stop_grad(e_first)``) stops the gradient of the whole routing output of the
    first segment: neither the segment's hidden states nor the router weight W_r learn from it.
    ``"none"`` (default) follows the paper. ``"router"`` stops the gradient only at the segment mean, so
    W_r is still trained on segment 0, whose weights see the segment's own later tokens in the forward
    (the suite's earlier behaviour, kept for comparison). Either way the forward of segment 0 uses its
    own tokens, as published.

The dense start (a switchable default, ``dense_fraction``):
    The paper trains the model dense for the first 5% of the steps and then copies the FFN into every
    expert (Sec. 4.1 and Appendix G.3, "crucial" for the experts to be used). Here the router carries the
    schedule: ``dense_steps = round(dense_fraction * schedule_steps)`` (``schedule_steps`` is filled with
    the run's ``schedule.steps`` by the run config; without it, e.g. a router built outside a training
    run, there is no dense phase). While ``step < dense_steps`` the merge layer
    (:class:`baselines.lory_layer.LoryMoELayer`) runs one dense FFN on every token and the router is not
    used (its weight W_r gets no gradient: ``requires_grad`` is off, so the CPU path's AdamW, which reads
    ``.grad``, neither updates it nor counts the step, as if the router were created at the switch;
    megatron's GPU optimizer copies every parameter's zero ``main_grad`` instead, so there W_r takes
    zero-gradient steps: weight decay only, and Adam's bias correction counts them, which makes its first
    updates after the switch larger than a fresh optimizer's). The dense FFN is held as E tied,
    bit-identical copies in the experts' parameters (:mod:`baselines.lory_layer`), so at the switch step
    every expert *is* the dense FFN, with the same optimizer state: the paper's copy, with nothing to do at
    the switch and nothing outside the state dict (the phase is derived from the ``step`` buffer, so a
    resume before, at or after the switch is exact). ``dense_fraction=0`` turns the dense start off.

Shape legend: T tokens (t = s * B + b), S sequence length, B sequences, D hidden size, E experts,
G segments per sequence (see :mod:`routers.base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from baselines._gate import GatedRouter
from routers.base import RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, require
from routers.metrics import routing_metrics
from routers.registry import register_router

#: ``first_segment_grad`` values (see the module docstring).
FIRST_SEGMENT_GRADS = ("none", "router")


@dataclass(frozen=True)
class LoryConfig(RouterConfig):
    """Options of the Lory router (the module docstring gives the first segment's and the dense start's)."""

    # Tokens per segment along each sequence (paper: 256); the last segment of a sequence is shorter when the
    # sequence length is not a multiple.
    segment_len: int = 256
    # What learns from the first segment's routing: "none" (the paper's) or "router" (only the mean is
    # detached; W_r learns).
    first_segment_grad: str = "none"
    init_std: float = 0.01
    dense_fraction: float = 0.05  # share of the run's steps trained dense (paper: 0.05; 0 turns it off)
    # The run's total steps (filled with schedule.steps by the run config); None means no dense phase.
    schedule_steps: int | None = None

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


def num_segments(seq_len: int, segment_len: int) -> int:
    """G = ceil(S / segment_len), the segments of a sequence of ``seq_len`` tokens."""
    return math.ceil(seq_len / segment_len)


def segment_means(hidden_TD: torch.Tensor, seq_shape: tuple[int, int] | None, segment_len: int) -> torch.Tensor:
    """``[B, G, D]`` float32: the mean hidden state of every segment of every sequence (``seq_shape`` ``(S, B)``,
    ``None`` one sequence); the last segment of a sequence may be shorter, averaged over the tokens it has."""
    T, D = hidden_TD.shape
    S, B = (T, 1) if seq_shape is None else seq_shape
    G = num_segments(S, segment_len)
    hidden_SBD = hidden_TD.float().reshape(S, B, D)
    pad = G * segment_len - S
    if pad:
        # Zero-pad the last segment; its mean divides by its true length below.
        hidden_SBD = torch.cat([hidden_SBD, hidden_SBD.new_zeros(pad, B, D)], dim=0)
    sums_GBD = hidden_SBD.view(G, segment_len, B, D).sum(dim=1)
    counts_G = torch.full((G,), float(segment_len), device=hidden_TD.device)
    counts_G[-1] = S - (G - 1) * segment_len
    return (sums_GBD / counts_G[:, None, None]).permute(1, 0, 2)


def _sync_phase_after_load(module: LoryRouter, _incompatible_keys) -> None:
    """``load_state_dict`` post-hook: the dense phase follows the loaded ``step`` buffer."""
    module._dense_phase = int(module.step) < module.config.dense_steps


@register_router("lory")
class LoryRouter(GatedRouter):
    """Lory's causal segment routing (Zhong et al. 2024).

    Every sequence is cut into segments of ``segment_len`` tokens along its length. Segment g >= 1 of a
    sequence is routed by ``softmax(W_r mean(h of segment g-1))``, so its weights use only earlier tokens;
    the first segment is routed on the mean of its own hidden states with a stop-gradient (the module
    docstring). Every token of a segment gets that segment's weights as ``probs [T, E]``; ``routing_map`` is
    all True (kind MERGE: the merge layer mixes all E experts' parameters). The whole path is differentiable
    and there is no aux loss. Metric: ``num_segments`` (G).

    The paper's inference rule, routing once on the prompt, is the merge layer's
    (``routers.megatron_adapter.prompt_routing``); for the first ``config.dense_steps`` steps
    (:attr:`dense_phase`) that layer trains one dense FFN and does not call the router.
    """

    Config = LoryConfig
    merges_experts = True
    # Lory trains on chains of similar documents (its paper's data batching, Sec. 3.2). The tiny flavour's
    # 128-token sequences would be one 256-token segment each (routed on itself): 32 keeps several segments
    # per sequence, so the cross-segment routing runs.
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
        # The phase follows the step buffer: set by set_step, recomputed when a state dict is loaded.
        self._dense_phase = config.dense_steps > 0
        self.register_load_state_dict_post_hook(_sync_phase_after_load)

    @property
    def dense_phase(self) -> bool:
        """Whether the model trains dense at the current step (``step < config.dense_steps``)."""
        return self._dense_phase

    def set_step(self, step: int) -> None:
        """Set the step; in the dense phase W_r takes no gradient (no AdamW step, no decay), after it it does."""
        super().set_step(step)
        self._dense_phase = int(step) < self.config.dense_steps
        if self.config.dense_steps > 0:
            self.weight.requires_grad_(not self._dense_phase)

    @property
    def constraint(self) -> RoutingConstraint:
        E = self.num_experts
        return RoutingConstraint(RoutingKind.MERGE, E, E, top_k=self.top_k, probs_sum_to_one=True)

    def segment_weights(self, hidden_TD: torch.Tensor, seq_shape: tuple[int, int] | None = None) -> torch.Tensor:
        """``[B, G, E]`` float32, the expert weights of every segment (what the merge layer mixes the experts'
        parameters with), each row on the simplex: row g is ``softmax(W_r mean(segment g-1))`` for g >= 1, and
        for g = 0 ``stopgrad(softmax(W_r mean(segment 0)))`` (paper, default) or
        ``softmax(W_r stopgrad(mean(segment 0)))`` (``first_segment_grad="router"``)."""
        means_BGD = segment_means(hidden_TD, seq_shape, self.config.segment_len)
        # Segment g reads segment g-1 (causal); the first reads itself, detached.
        route_on_BGD = torch.cat([means_BGD[:, :1].detach(), means_BGD[:, :-1]], dim=1)
        with torch.autocast(device_type=hidden_TD.device.type, enabled=False):
            logits_BGE = route_on_BGD @ self.weight.float().t()
        weights_BGE = torch.softmax(logits_BGE, dim=-1)
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
        metrics: dict[str, torch.Tensor] = {}
        if self.collect_metrics:
            metrics = routing_metrics(probs_TE, routing_map_TE)
            metrics["num_segments"] = torch.tensor(float(weights_BGE.shape[1]), device=hidden_TD.device)
        return RouterOutput(probs_TE, routing_map_TE, {}, metrics)
