"""The thin adapter from the project's :class:`routers.base.Router` to megatron-core's router protocol.

megatron-core 0.16.1's ``MoESubmodules.router`` is a *builder* ``router(config=, pg_collection=)`` of an object
with ``set_layer_number(n)`` and ``forward(hidden [s, b, h], padding_mask) -> (probs [T, E], routing_map [T, E])``;
``MoESubmodules(..., router=megatron_router_builder("switch", {"aux_loss_coeff": 1e-2}))`` makes one.

Each forward flattens ``[S, B, D]`` to float32 ``hidden_TD`` (``t = s * B + b``) and routes it with
``seq_shape=(S, B)`` (and token ids where required); attaches each weighted aux loss to ``probs`` with
``MoEAuxLossAutoScaler`` as ``TopKRouter`` does (gradient injected in the backward, not added to the LM loss); in
training, logs each per layer to megatron's tracker, *weighted* (no single coefficient to divide by) and
rank-local; and sums metrics and aux losses per layer in ``self.stats`` until reset (around an evaluation).

Token ids (Hash), which megatron-core does not pass to the router: wrap the forward in :func:`token_ids_context`
(``with token_ids_context(model, input_ids_BS): loss_BS = model(...)``). The ids reach *that* model's adapters
only, cleared on exit (even on error). Activation recomputation is unsupported for id-dependent routers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
from torch import nn

from routers.base import Router
from routers.registry import build_router


class RoutingStats:
    """Per-layer running sums of a router's metrics and aux losses (scalars or ``[E]``); one per adapter."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self.metric_sums: dict[str, torch.Tensor] = {}
        self.aux_loss_sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.metric_count = 0  # forwards that returned metrics (logging steps: Router.collect_metrics)

    def add(self, metrics: dict[str, torch.Tensor], aux_losses: dict[str, torch.Tensor]) -> None:
        """Accumulate one forward's (detached) metrics (possibly none) and aux losses."""
        self.metric_count += bool(metrics)
        for sums, values in ((self.metric_sums, metrics), (self.aux_loss_sums, aux_losses)):
            for key, value in values.items():
                value = value.detach().float()
                sums[key] = sums[key] + value if key in sums else value.clone()
        self.count += 1

    def means(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(metrics, aux_losses)`` averaged over the forwards since the last reset (empty if none)."""
        return ({k: v / self.metric_count for k, v in self.metric_sums.items()},
                {k: v / self.count for k, v in self.aux_loss_sums.items()})


class MegatronRouterAdapter(MegatronModule):
    """A project :class:`Router` behind megatron-core's router protocol (module docstring), built from megatron's
    TransformerConfig, process groups (unused: routers see only local tokens), ``router_name`` and its options.

    Attributes:
        router: the wrapped :class:`Router`.
        layer_number: set by megatron (1-based, global over the pipeline).
        last_metrics, last_aux_losses: detached, of the last forward (``{}`` before the first).
        stats: a :class:`RoutingStats` accumulating over forwards until reset.
        token_ids: the flattened ``[T]`` token ids set by :func:`token_ids_context` (None outside it).
    """

    def __init__(
        self, *, config, pg_collection=None, router_name: str, router_options: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config)
        self.router: Router = build_router(
            router_name, hidden_size=config.hidden_size, num_experts=config.num_moe_experts,
            top_k=config.moe_router_topk, **(router_options or {}),
        )
        self.layer_number: int | None = None
        self.last_metrics: dict[str, torch.Tensor] = {}
        self.last_aux_losses: dict[str, torch.Tensor] = {}
        self.stats = RoutingStats()
        self.token_ids: torch.Tensor | None = None  # set only inside token_ids_context

    def set_layer_number(self, layer_number: int) -> None:
        """Called by megatron's TransformerLayer (1-based); passed on to the router."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def forward(
        self, hidden_SBD: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route one layer's ``[S, B, D]`` micro-batch: ``(probs [T, E] float32 with the aux losses attached,
        routing_map [T, E] bool)``. ``RuntimeError`` if needed token ids are unset."""
        if padding_mask is not None:
            raise NotImplementedError(
                "the suite's routers do not take megatron's padding_mask (pretraining uses packed sequences)"
            )
        S, B, D = hidden_SBD.shape
        hidden_TD = hidden_SBD.reshape(S * B, D).float()
        # Only routers that declare the need get ids (Lory's prompt routing routes B means inside an S * B forward).
        token_ids_T = self.token_ids if self.router.requires_token_ids else None
        if self.router.requires_token_ids and token_ids_T is None:
            raise RuntimeError(
                f"router '{self.router.name}' (layer {self.layer_number}) needs token ids, but none were set: "
                "wrap the model's forward in `with routers.megatron_adapter.token_ids_context(model, input_ids):`"
            )
        if token_ids_T is not None:
            if token_ids_T.numel() != S * B:
                raise RuntimeError(
                    f"token ids cover {token_ids_T.numel()} tokens but layer {self.layer_number} routes "
                    f"{S * B} (S={S}, B={B}); were the ids set for another batch?"
                )
            token_ids_T = token_ids_T.to(hidden_TD.device)

        out = self.router(hidden_TD, token_ids_T, (S, B))
        probs_TE = out.probs

        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        if self.training and torch.is_grad_enabled():  # training forwards only, like TopKRouter
            for name, loss in out.aux_losses.items():
                if loss.requires_grad:
                    # As TopKRouter: with per-token loss the final gradient scaling divides by the token count.
                    scaled = loss * probs_TE.shape[0] if self.config.calculate_per_token_loss else loss
                    probs_TE = MoEAuxLossAutoScaler.apply(probs_TE, scaled)
                save_to_aux_losses_tracker(name, loss.detach().float(), self.layer_number, num_layers)

        self.last_metrics = {k: v.detach() for k, v in out.metrics.items()}
        self.last_aux_losses = {k: v.detach() for k, v in out.aux_losses.items()}
        self.stats.add(self.last_metrics, self.last_aux_losses)
        return probs_TE, out.routing_map

    def extra_repr(self) -> str:
        return f"layer_number={self.layer_number}"


def megatron_router_builder(router_name: str, router_options: dict[str, Any] | None = None):
    """A ``MoESubmodules.router`` builder of a :class:`MegatronRouterAdapter` around ``router_name``."""
    return functools.partial(MegatronRouterAdapter, router_name=router_name, router_options=dict(router_options or {}))


def router_adapters(model: nn.Module) -> list[MegatronRouterAdapter]:
    """The adapters inside ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MegatronRouterAdapter)]


@contextlib.contextmanager
def token_ids_context(model: nn.Module, input_ids_BS: torch.Tensor) -> Iterator[torch.Tensor]:
    """Give ``model``'s adapters the batch's ``[B, S]`` token ids for the block; yields them as ``[T]``
    (``t = s * B + b``). ``RuntimeError`` when nested (ambiguous)."""
    if input_ids_BS.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got {tuple(input_ids_BS.shape)}")
    adapters = router_adapters(model)
    if any(a.token_ids is not None for a in adapters):
        raise RuntimeError("token ids are already set on this model (nested token_ids_context?)")
    token_ids_T = input_ids_BS.detach().transpose(0, 1).reshape(-1)
    for adapter in adapters:
        adapter.token_ids = token_ids_T
    try:
        yield token_ids_T
    finally:
        for adapter in adapters:
            adapter.token_ids = None


@contextlib.contextmanager
def prompt_routing(model: nn.Module, prompt_lengths_B: torch.Tensor | list[int]) -> Iterator[None]:
    """For the block, route every sequence once on its prompt (``[B]`` lengths >= 1) in the layers that support it
    (``set_prompt_lengths``: Lory's inference rule); cleared on exit (even on error)."""
    lengths_B = torch.as_tensor(prompt_lengths_B, dtype=torch.long)
    if lengths_B.dim() != 1 or bool((lengths_B < 1).any()):
        raise ValueError(f"prompt_lengths must be a [B] vector of positive lengths, got {prompt_lengths_B}")
    layers = [m for m in model.modules() if callable(getattr(m, "set_prompt_lengths", None))]
    for layer in layers:
        layer.set_prompt_lengths(lengths_B)
    try:
        yield
    finally:
        for layer in layers:
            layer.set_prompt_lengths(None)


def collect_routing_metrics(model: nn.Module) -> dict[int, dict[str, torch.Tensor]]:
    """``{layer_number: {metric: mean since the last reset}}`` (:func:`reset_routing_stats` clears them)."""
    return {a.layer_number: means for a in router_adapters(model) if (means := a.stats.means()[0])}


def collect_aux_losses(model: nn.Module) -> dict[int, dict[str, torch.Tensor]]:
    """``{layer_number: {loss name: mean}}`` (weighted, detached), as :func:`collect_routing_metrics`."""
    return {a.layer_number: means for a in router_adapters(model) if (means := a.stats.means()[1])}


def reset_routing_stats(model: nn.Module) -> None:
    """Clear the accumulated metrics and aux losses of every adapter in ``model``."""
    for adapter in router_adapters(model):
        adapter.stats.reset()
