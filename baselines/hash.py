"""Hash routing: a fixed map from token id to experts, no learned gate.

References:
    Roller, Sukhbaatar, Szlam, Weston, "Hash Layers For Large Sparse Models", NeurIPS 2021 (arXiv:2106.04426):
    a fixed hash per token id, random or balanced over token frequencies. Code: ParlAI ``hash_ladder.py``
    (``HashLayerFFN.hash``: a random bin per id, ``random.seed(42)``, one hash layer).
    Wang, Zhu, Chen, "ReMoE", ICLR 2025 (arXiv:2412.14711), Sec. 4.2: "we use mod E hashing function" (``mod``).

Paper gaps and deviations, each switchable:

1. Balanced construction at k > 1 (the paper's k is 1): the k emptiest buckets, distinct (``balance_rule``).
2. One table for all layers (``per_layer=False``, default: what ReMoE's ``mod`` does; ParlAI's single hash layer
   does not settle it) or one per layer (seed ``seed + layer_number``); refused for ``mod``.
3. k > 1: each routed expert gets weight 1/k; the papers use k = 1.

The table is the persistent buffer ``table``: a checkpoint carries it (``balanced`` needs no counts file later).

Shape legend: T tokens, D hidden size, E experts, V vocabulary (see :mod:`routers.base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from routers import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, register_router
from routers.base import require

HASH_TYPES = ("random", "mod", "balanced")
BALANCE_RULES = ("greedy", "random-greedy")


@dataclass(frozen=True)
class HashConfig(RouterConfig):
    """Options of the Hash router (the tables: :func:`build_hash_table`)."""

    hash_type: str = "random"  # "random", "mod" or "balanced" (built from counts_path)
    seed: int = 42  # seed of the "random" and "balanced" tables (seed + layer_number with per_layer)
    vocab_size: int = 50304  # V: GPT-2's 50257 padded to a multiple of 128 (as megatron-core); larger ids fail
    counts_path: str | None = None  # .npy of per-id corpus token counts (length <= V); "balanced" only
    per_layer: bool = False  # one table per layer instead of one shared by every layer
    balance_rule: str = "greedy"  # "balanced" placement: "greedy" or "random-greedy"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.hash_type in HASH_TYPES, "hash_type", self.hash_type, f"one of {HASH_TYPES}")
        require(0 <= self.seed < 2**63, "seed", self.seed, "in [0, 2**63)")
        require(self.vocab_size >= 1, "vocab_size", self.vocab_size, ">= 1")
        if (self.hash_type == "balanced") != (self.counts_path is not None):
            raise ValueError(
                f"counts_path is required by hash_type 'balanced' and only used by it "
                f"(hash_type={self.hash_type!r}, counts_path={self.counts_path!r})"
            )
        require(self.balance_rule in BALANCE_RULES, "balance_rule", self.balance_rule, f"one of {BALANCE_RULES}")
        if self.per_layer and self.hash_type == "mod":
            raise ValueError("per_layer has no effect with hash_type 'mod' (id mod E is the same in every layer)")


def load_token_counts(path: str, vocab_size: int) -> np.ndarray:
    """``[V]`` int64 counts from a ``.npy`` of non-negative counts per id (at most V; the rest 0), else ValueError."""
    try:
        counts = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"counts_path {path}: unreadable token counts ({exc})") from None
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"counts_path {path}: expected a 1-D integer array, got {counts.dtype} {counts.shape}")
    if counts.size > vocab_size:
        raise ValueError(f"counts_path {path}: {counts.size} token ids > vocab_size={vocab_size}")
    if counts.size and int(counts.min()) < 0:
        raise ValueError(f"counts_path {path}: negative token counts")
    return np.pad(counts.astype(np.int64), (0, vocab_size - counts.size))


def balanced_table(counts_V: np.ndarray, num_experts: int, top_k: int, seed: int, rule: str = "greedy") -> torch.Tensor:
    """The ``[V, k]`` ``balanced`` table of ``[V]`` counts: most frequent id first, by ``rule``, ``"greedy"`` (the
    paper's Sec. 3) to the k least loaded experts, ``"random-greedy"`` to k drawn (``seed``) among those staying
    within ``ceil(k * total / E)``, else the k least loaded. Every expert ends within one token's count of an equal
    share; unseen ids go round-robin."""
    V, E, k = counts_V.shape[0], num_experts, top_k
    rng = np.random.default_rng(seed)
    table = np.empty((V, k), dtype=np.int64)
    load_E = np.zeros(E, dtype=np.int64)
    capacity = math.ceil(k * int(counts_V.sum()) / E)
    # Most frequent first (stable, so equal counts keep id order); ids never seen go round-robin.
    order = np.argsort(-counts_V, kind="stable")
    seen = order[counts_V[order] > 0]
    for token in seen:
        c = int(counts_V[token])
        room = np.flatnonzero(load_E + c <= capacity)
        if rule == "random-greedy" and room.size >= k:
            chosen = rng.choice(room, size=k, replace=False)
        else:  # the k least loaded (ties to the lower index)
            chosen = np.argsort(load_E, kind="stable")[:k]
        table[token] = chosen
        load_E[chosen] += c
    unseen = order[counts_V[order] == 0]
    ranks = np.arange(unseen.size)[:, None] * k + np.arange(k)[None, :]
    table[unseen] = ranks % E
    return torch.from_numpy(table)


def build_hash_table(config: HashConfig, layer_number: int | None = None) -> torch.Tensor:
    """The ``[V, k]`` long table (k distinct experts per id); ``layer_number`` seeds ``per_layer`` tables."""
    V, E, k = config.vocab_size, config.num_experts, config.top_k
    if config.hash_type == "mod":
        return (torch.arange(V)[:, None] + torch.arange(k)[None, :]) % E
    seed = config.seed + (layer_number or 0) if config.per_layer else config.seed
    if config.hash_type == "balanced":
        return balanced_table(load_token_counts(config.counts_path, V), E, k, seed, config.balance_rule)
    generator = torch.Generator().manual_seed(seed)
    # argsort of i.i.d. uniforms: a uniform random permutation per row.
    return torch.rand(V, E, generator=generator).argsort(dim=-1)[:, :k].contiguous()


@register_router("hash")
class HashRouter(Router):
    """Hash routing (Roller et al. 2021): token id -> k fixed experts of ``table`` ``[V, k]``, weight 1/k each; no
    parameters, no aux loss. Ids outside ``[0, vocab_size)`` raise ``ValueError`` when :attr:`collect_metrics` is
    set (read on the host), else fail a device-side assert (``RuntimeError``): the forward forces no host sync."""

    Config = HashConfig
    # ReMoE's Hash baseline (the ledger's 185M row) hashes id mod E (Sec. 4.2).
    recipe_overrides = {"185m": ("router.options.hash_type=mod",)}
    requires_token_ids = True

    def __init__(self, config: HashConfig) -> None:
        super().__init__(config)
        self.register_buffer("table", build_hash_table(config))

    def set_layer_number(self, layer_number: int) -> None:
        """With ``per_layer``, draw this layer's own table (seed ``seed + layer_number``)."""
        if self.config.per_layer:
            self.table.copy_(build_hash_table(self.config, layer_number))

    @property
    def constraint(self) -> RoutingConstraint:
        return RoutingConstraint(RoutingKind.EXACT_K, self.top_k, self.top_k, top_k=self.top_k, probs_sum_to_one=True)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        if token_ids_T.dtype.is_floating_point or token_ids_T.dtype == torch.bool:
            raise ValueError(f"token_ids_T must be an integer tensor, got {token_ids_T.dtype}")
        V = self.config.vocab_size
        if token_ids_T.numel() and self.collect_metrics:
            lo, hi = int(token_ids_T.min()), int(token_ids_T.max())
            if lo < 0 or hi >= V:
                bad = hi if hi >= V else lo
                raise ValueError(f"token id {bad} is outside [0, vocab_size={V}); set the router's vocab_size")
        elif token_ids_T.numel():  # the same check without a host read: a device-side assert
            in_range = ((token_ids_T >= 0) & (token_ids_T < V)).all()
            torch._assert_async(in_range, f"a token id is outside [0, vocab_size={V}); set the router's vocab_size")
        experts_Tk = self.table[token_ids_T.to(self.table.device).long()]
        T, E = hidden_TD.shape[0], self.num_experts
        routing_map_TE = torch.zeros(T, E, dtype=torch.bool, device=hidden_TD.device)
        routing_map_TE.scatter_(1, experts_Tk.to(hidden_TD.device), True)
        probs_TE = routing_map_TE.float() / self.top_k
        return self.output(probs_TE, routing_map_TE)
