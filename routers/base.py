"""The router interface shared by DirMoE and every baseline: one MoE layer's ``hidden_TD`` (and, if needed,
``token_ids_T``) to a :class:`RouterOutput` in megatron-core's vocabulary (probs, routing_map), so the adapter is thin.

Shape suffixes used throughout the project: T tokens in the (flattened) micro-batch, in megatron-core's order
t = s_idx * B + b_idx; S sequence length; B micro-batch size (sequences); D hidden size; E experts; G segments
(Lory); L layers.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from routers.metrics import routing_metrics


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(ok: bool, name: str, value: object, rule: str) -> None:
    """``ValueError("<name> must be <rule>, got <value!r>")`` unless ``ok``: the routers' option checks."""
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class RouterConfig:
    """Options every router takes. Routers subclass this with their own frozen fields."""

    hidden_size: int  # D, the width of the hidden states the router reads
    num_experts: int  # E
    top_k: int = 1  # k, the nominal number of experts per token (the compute-parity target)

    def __post_init__(self) -> None:
        require(self.hidden_size >= 1, "hidden_size", self.hidden_size, ">= 1")
        require(self.num_experts >= 2, "num_experts", self.num_experts, ">= 2")
        require(1 <= self.top_k <= self.num_experts, "top_k", self.top_k, f"in [1, num_experts={self.num_experts}]")

    @classmethod
    def option_names(cls) -> list[str]:
        """Names of the router-specific options (everything but hidden_size/num_experts/top_k)."""
        return [f.name for f in dataclasses.fields(cls) if f.name not in ("hidden_size", "num_experts", "top_k")]


class RoutingKind(enum.StrEnum):
    """How a router constrains the routing map, declared as data and checked by the contract suite."""

    EXACT_K = "exact_k"  # every token goes to exactly k experts
    CAPACITY = "capacity"  # each expert takes at most `capacity(T)` tokens (k per token at most)
    EXPERT_CHOICE = "expert_choice"  # each expert takes exactly `capacity(T)` tokens
    VARIABLE = "variable"  # any number of experts per token, between min and max
    MERGE = "merge"  # no dispatch: expert parameters are merged with the weights (Lory)


@dataclass(frozen=True)
class RoutingConstraint:
    """A router's declared constraint on ``routing_map`` (and ``probs``)."""

    kind: RoutingKind
    min_experts_per_token: int  # bounds of routing_map.sum(-1)
    max_experts_per_token: int
    capacity_factor: float | None = None  # CAPACITY / EXPERT_CHOICE: c in capacity(T) = ceil((T * k / E) * c)
    top_k: int = 1  # the router's k, used by the capacity formula
    probs_sum_to_one: bool = False  # whether each routed token's probs sum to one

    def capacity(self, num_tokens: int, num_experts: int) -> int:
        """megatron-core's ``get_capacity``, ceil((T*k/E) * c), in its operation order (identical rounding)."""
        if self.capacity_factor is None:
            return num_tokens
        return min(num_tokens, math.ceil((num_tokens * self.top_k / num_experts) * self.capacity_factor))

    def check(self, routing_map_TE: torch.Tensor) -> None:
        """Raise ``AssertionError`` naming the violation if ``routing_map_TE`` breaks the constraint."""
        T, E = routing_map_TE.shape
        per_token_T = routing_map_TE.sum(-1)
        per_expert_E = routing_map_TE.sum(0)
        lo, hi = int(per_token_T.min()), int(per_token_T.max())
        assert lo >= self.min_experts_per_token and hi <= self.max_experts_per_token, (
            f"{self.kind.value}: experts per token in [{lo}, {hi}], declared "
            f"[{self.min_experts_per_token}, {self.max_experts_per_token}]"
        )
        if self.kind in (RoutingKind.CAPACITY, RoutingKind.EXPERT_CHOICE):
            cap = self.capacity(T, E)
            assert int(per_expert_E.max()) <= cap, f"an expert took {int(per_expert_E.max())} > capacity {cap}"
            if self.kind is RoutingKind.EXPERT_CHOICE:
                assert bool((per_expert_E == cap).all()), f"expert loads {per_expert_E.tolist()} != {cap}"


@dataclass
class RouterOutput:
    """What a router returns for one micro-batch of one layer."""

    probs: torch.Tensor  # [T, E] float32 combine weights, exactly zero where routing_map is False
    routing_map: torch.Tensor  # [T, E] bool, which experts receive each token
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)  # named scalars, weighted, attached
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # named, detached (scalars or [E])

    def total_aux_loss(self) -> torch.Tensor:
        """Sum of the aux losses (a zero scalar on ``probs``' device when there are none)."""
        return sum(self.aux_losses.values(), torch.zeros((), device=self.probs.device, dtype=torch.float32))


class Router(nn.Module):
    """Base class of every router: subclasses set ``Config`` (a frozen :class:`RouterConfig` subclass), implement
    :meth:`route` and :attr:`constraint`, and register with :func:`routers.register_router`. The training step is
    the ``step`` buffer, so step-dependent schedules restore with the ``state_dict`` and resume bit-identically."""

    Config: ClassVar[type[RouterConfig]] = RouterConfig
    name: ClassVar[str] = ""
    #: Needs token ids (Hash): megatron-core does not pass them, the adapter does.
    requires_token_ids: ClassVar[bool] = False
    #: Merges expert parameters instead of dispatching (Lory: one expert's compute); must match ``constraint.kind``.
    merges_experts: ClassVar[bool] = False
    #: Buffers kept float32 on casts (as megatron's ``_maintain_float32_expert_bias``): bf16 would lose small steps.
    fp32_buffers: ClassVar[tuple[str, ...]] = ()
    #: Per-flavour dot-list overrides of the recipe (``repro.experiments``); here so no central code names a router.
    recipe_overrides: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    #: Suite-added variants (not the paper's), dot-list overrides at every flavour: ``<router>+<variant>-<flavour>``.
    variants: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    #: Whether :meth:`route` computes ``metrics`` (``routers.schedule.begin_step``: True on logging steps). When
    #: False it returns ``{}`` and forces no host sync (no ``.item()``, ``int(t)``, ``bool(t)``, ``nonzero``, mask
    #: indexing, data-dependent shapes) unless its routing needs one (documented); all else is identical.
    collect_metrics: bool = True

    @classmethod
    def moe_layer_class(cls) -> type | None:
        """The MoE layer class to use instead of megatron's ``MoELayer`` (None: the standard one; Lory: merging)."""
        return None

    def __init__(self, config: RouterConfig) -> None:
        super().__init__()
        if not isinstance(config, self.Config):
            raise TypeError(f"{type(self).__name__} needs a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def _apply(self, fn, recurse: bool = True):
        """Cast or move as ``nn.Module`` does, then put the :attr:`fp32_buffers` back in float32."""
        kept = {name: getattr(self, name) for name in self.fp32_buffers}
        result = super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            if after.dtype != torch.float32:
                setattr(self, name, before.to(device=after.device, dtype=torch.float32))
        return result

    @property
    def constraint(self) -> RoutingConstraint:
        """The routing constraint this router guarantees."""
        raise NotImplementedError

    def route(
        self, hidden_TD: torch.Tensor, token_ids_T: torch.Tensor | None = None, seq_shape: tuple[int, int] | None = None
    ) -> RouterOutput:
        """Route one micro-batch (subclass docstrings name their aux losses and metrics).

        Args:
            hidden_TD: ``[T, D]`` hidden states at the MoE layer's input.
            token_ids_T: ``[T]`` token ids, in the same order, for routers that need them.
            seq_shape: ``(S, B)``, ``T == S * B``, order ``t = s * B + b`` (megatron's ``[s, b, h]`` flattened),
                for routers that need sequences (Lory); None: one sequence of length T.
        """
        raise NotImplementedError

    def forward(
        self, hidden_TD: torch.Tensor, token_ids_T: torch.Tensor | None = None, seq_shape: tuple[int, int] | None = None
    ) -> RouterOutput:
        """Validate inputs and call :meth:`route` (see there for Args/Returns)."""
        if hidden_TD.dim() != 2 or hidden_TD.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"{self.name}: hidden states must be [T, {self.config.hidden_size}], got {tuple(hidden_TD.shape)}"
            )
        if self.requires_token_ids:
            if token_ids_T is None:
                raise ValueError(f"router '{self.name}' needs token_ids_T, got None")
            if token_ids_T.shape != hidden_TD.shape[:1]:
                raise ValueError(
                    f"{self.name}: token ids {tuple(token_ids_T.shape)} do not match {hidden_TD.shape[0]} tokens"
                )
        if seq_shape is not None and seq_shape[0] * seq_shape[1] != hidden_TD.shape[0]:
            raise ValueError(f"{self.name}: seq_shape {seq_shape} does not cover {hidden_TD.shape[0]} tokens")
        return self.route(hidden_TD, token_ids_T, seq_shape)

    def output(
        self, probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, aux_losses: dict[str, torch.Tensor] | None = None,
        extra_metrics: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> RouterOutput:
        """The :class:`RouterOutput`; its metrics, only when :attr:`collect_metrics`, are :func:`routing_metrics`
        followed by ``extra_metrics()`` (called only then, so the others cost nothing)."""
        metrics: dict[str, torch.Tensor] = {}
        if self.collect_metrics:
            metrics = routing_metrics(probs_TE, routing_map_TE)
            metrics.update(extra_metrics() if extra_metrics else {})
        return RouterOutput(probs_TE, routing_map_TE, aux_losses or {}, metrics)

    def set_step(self, step: int) -> None:
        """Tell the router the global training step (before the step's forward passes)."""
        self.step.fill_(int(step))

    def step_statistic(self) -> torch.Tensor | None:
        """This step's statistic for the schedule, averaged over layers and ranks (ReMoE's sparsity), or None,
        chosen without reading a device value (no host sync)."""
        return None

    def end_step(self, global_statistic: torch.Tensor | None) -> None:
        """Called after each optimizer step with the averaged :meth:`step_statistic` (a device tensor: no sync)."""

    def set_layer_number(self, layer_number: int) -> None:
        """The router's 1-based layer, once the model is built (via the adapter); Hash's per-layer tables use it."""

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    @property
    def top_k(self) -> int:
        return self.config.top_k

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={getattr(self.config, k)!r}" for k in self.Config.option_names())
        return f"name={self.name!r}, E={self.num_experts}, k={self.top_k}" + (f", {opts}" if opts else "")
