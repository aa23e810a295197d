"""Hash routing: a fixed map from token id to experts, no learned gate.

References:
    Roller, Sukhbaatar, Szlam, Weston, "Hash Layers For Large Sparse Models", NeurIPS 2021
    (arXiv:2106.04426). Reference code: facebookresearch/ParlAI ``projects/params_vs_compute/hash_ladder``
    (a uniformly random bin per token id drawn with ``random.seed(42)``, kept as a plain attribute).
    The ``mod`` variant (expert = token id mod E) is the Hash baseline of the ReMoE paper
    (Wang et al., ICLR 2025, arXiv:2412.14711).

Shape legend: T tokens, D hidden size, E experts, V vocabulary (see :mod:`routers.base`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from routers.base import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind
from routers.metrics import routing_metrics
from routers.registry import register_router

HASH_TYPES = ("random", "mod")


@dataclass(frozen=True)
class HashConfig(RouterConfig):
    """Options of the Hash router.

    Args:
        hash_type: "random" (default: a seeded uniformly random table, Roller et al.) or "mod"
            (token id mod E, the ReMoE paper's variant).
        seed: seed of the random table; the same seed gives the same table (in every layer, as in
            ParlAI's reference, which seeds every hash layer with 42).
        vocab_size: V, the number of token ids the table covers (default 50304: GPT-2's 50257 padded
            to a multiple of 128, as megatron-core pads it). Larger ids are an error.
    """

    hash_type: str = "random"
    seed: int = 42
    vocab_size: int = 50304

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hash_type not in HASH_TYPES:
            raise ValueError(f"hash_type must be one of {HASH_TYPES}, got {self.hash_type!r}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")


def build_hash_table(config: HashConfig) -> torch.Tensor:
    """The ``[V, k]`` table of expert ids (k distinct experts per token id).

    Args:
        config: the router's config.

    Returns:
        A long tensor ``[V, k]``. "random": for every id, the first k entries of a uniformly random
        permutation of the experts drawn from a generator seeded with ``seed`` (for k = 1, a uniformly
        random expert). "mod": ``(id + j) mod E`` for j < k (for k = 1, ``id mod E``).
    """
    V, E, k = config.vocab_size, config.num_experts, config.top_k
    if config.hash_type == "mod":
        ids_V1 = torch.arange(V, dtype=torch.long)[:, None]
        return (ids_V1 + torch.arange(k, dtype=torch.long)[None, :]) % E
    generator = torch.Generator().manual_seed(config.seed)
    # argsort of i.i.d. uniforms is a uniform random permutation per row: k distinct experts per id.
    return torch.rand(V, E, generator=generator).argsort(dim=-1)[:, :k].contiguous()


@register_router("hash")
class HashRouter(Router):
    """Hash routing (Roller et al. 2021): token id -> k fixed experts, no learned gate.

    The table is the persistent buffer ``table`` ``[V, k]``, so a checkpoint carries it and a resumed
    or evaluated model routes exactly as in training whatever the seed option then says. Each routed
    expert gets weight 1/k: weight 1 for the k = 1 of the papers, and a mean of the k experts (weights
    summing to one) for k > 1, which the papers leave open. The output depends on the token ids only;
    the hidden states are read for their shape alone. There are no parameters and no aux loss.
    """

    Config = HashConfig
    requires_token_ids = True

    def __init__(self, config: HashConfig) -> None:
        super().__init__(config)
        self.register_buffer("table", build_hash_table(config))

    @property
    def constraint(self) -> RoutingConstraint:
        k = self.top_k
        return RoutingConstraint(RoutingKind.EXACT_K, k, k, top_k=k, probs_sum_to_one=True)

    def route(
        self,
        hidden_TD: torch.Tensor,
        token_ids_T: torch.Tensor | None = None,
        seq_shape: tuple[int, int] | None = None,
    ) -> RouterOutput:
        """Look the token ids up in the table.

        Args:
            hidden_TD: ``[T, D]`` hidden states (only their number and device are used).
            token_ids_T: ``[T]`` integer token ids in ``[0, vocab_size)``.
            seq_shape: unused.

        Returns:
            :class:`RouterOutput` with no aux loss.

        Raises:
            ValueError: token ids missing, not integers, or outside ``[0, vocab_size)``.
        """
        if token_ids_T is None:
            raise ValueError("hash routing needs token_ids_T")
        if token_ids_T.dtype.is_floating_point or token_ids_T.dtype == torch.bool:
            raise ValueError(f"token_ids_T must be an integer tensor, got {token_ids_T.dtype}")
        V = self.config.vocab_size
        if token_ids_T.numel():
            lo, hi = int(token_ids_T.min()), int(token_ids_T.max())
            if lo < 0 or hi >= V:
                bad = hi if hi >= V else lo
                raise ValueError(f"token id {bad} is outside [0, vocab_size={V}); set the router's vocab_size")
        experts_Tk = self.table[token_ids_T.to(self.table.device).long()]
        T, E = hidden_TD.shape[0], self.num_experts
        routing_map_TE = torch.zeros(T, E, dtype=torch.bool, device=hidden_TD.device)
        routing_map_TE.scatter_(1, experts_Tk.to(hidden_TD.device), True)
        probs_TE = routing_map_TE.float() / self.top_k
        return RouterOutput(probs_TE, routing_map_TE, {}, routing_metrics(probs_TE, routing_map_TE))
