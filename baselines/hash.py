"""Hash routing: a fixed map from token id to experts, no learned gate.

References:
    Roller, Sukhbaatar, Szlam, Weston, "Hash Layers For Large Sparse Models", NeurIPS 2021
    (arXiv:2106.04426): a token id is routed by a fixed hash, either a uniformly random bucket or an
    assignment built so that the load is balanced over the training corpus's token frequencies.
    Reference code: facebookresearch/ParlAI ``projects/params_vs_compute/hash_ladder/hash_ladder.py``
    (``HashLayerFFN.hash``: a uniformly random bin per token id drawn with ``random.seed(42)``, for the one
    hash layer the model has); the project README there: "each word in the dictionary is simply assigned
    to a fixed expert, which is either chosen at random or assigned such that the distribution is
    balanced".
    Wang, Zhu, Chen, "ReMoE", ICLR 2025 (arXiv:2412.14711), Sec. 4.2: "For the Hash method, we use mod E
    hashing function" (the ``mod`` table below), the Hash row of the table the ledger compares against.

The three tables (``hash_type``):

* ``random`` (default): every id gets the first k entries of a uniformly random permutation of the
  experts (k = 1: a uniformly random expert), from a generator seeded with ``seed``.
* ``mod``: ``(id + j) mod E`` for j < k (k = 1: ``id mod E``), ReMoE's Hash baseline. It does not depend
  on the data, the seed or the layer.
* ``balanced``: built from the token counts of the training corpus (``counts_path``, a ``.npy`` of counts
  per id written by :func:`repro.data.token_counts.write_token_counts`). Ids are visited from the most to
  the least frequent; ``balance_rule`` says where each goes:

  - ``"greedy"`` (default), the Hash Layers paper's rule (Roller et al. 2021, Sec. 3, its hashing
    functions, "Balanced assignment": tokens sorted by frequency, each to the currently emptiest bucket): the id
    goes to the k least loaded experts (summed counts so far; ties to the lower expert index). It draws
    nothing, so the seed does not matter.
  - ``"random-greedy"``, the suite's earlier rule: k distinct experts drawn uniformly (seeded) among those
    whose load stays within ``ceil(k * total / E)`` after taking the id, or the k least loaded when fewer
    have room.

  Either way the most frequent ids are spread first and every expert ends within one token's count of an
  equal share of the corpus's tokens. Ids never seen in the corpus (count 0) are spread round-robin over
  the experts so that unseen ids do not pile on one expert.

Paper gaps and deviations, each a switchable option:

1. The balanced construction at k > 1 (the paper's k is 1): the k emptiest buckets, distinct. The
   ``random-greedy`` rule is kept as an alternative (``balance_rule``); both are checked in
   ``tests/test_baselines.py``.
2. One table for every layer (``per_layer=False``, default) or one per layer (``per_layer=True``, the
   ``random`` and ``balanced`` tables are then drawn with seed ``seed + layer_number``, the number megatron
   gives the layer, 1-based). ParlAI's reference has a single hash layer, so it does not settle the
   question; the default keeps what ReMoE's ``mod`` hash does by construction (the same map in every
   layer). ``per_layer`` has no meaning for ``mod`` and is refused there.
3. k > 1: each routed expert gets weight 1/k (a mean of the k experts); the papers use k = 1.

Whatever the options, the table is the persistent buffer ``table``, so a checkpoint carries it (the
``balanced`` table with it: the run routes the same at evaluation even without the counts file).

Shape legend: T tokens, D hidden size, E experts, V vocabulary (see :mod:`routers.base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from routers.base import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, require
from routers.metrics import routing_metrics
from routers.registry import register_router

HASH_TYPES = ("random", "mod", "balanced")
#: ``balance_rule`` values of the ``balanced`` table (see the module docstring).
BALANCE_RULES = ("greedy", "random-greedy")


@dataclass(frozen=True)
class HashConfig(RouterConfig):
    """Options of the Hash router (see the module docstring for the tables)."""

    hash_type: str = "random"  # "random", "mod" or "balanced" (built from counts_path)
    seed: int = 42  # seed of the "random" and "balanced" tables (seed + layer_number with per_layer)
    # V, the number of token ids the table covers (default 50304: GPT-2's 50257 padded to a multiple of 128,
    # as megatron-core pads it). Larger ids are an error.
    vocab_size: int = 50304
    # A .npy file of per-id token counts of the training corpus (length at most V; missing trailing ids count
    # 0), required by and only used with "balanced".
    counts_path: str | None = None
    per_layer: bool = False  # draw a separate table per layer instead of one table shared by every layer
    balance_rule: str = "greedy"  # how the "balanced" table places each id: "greedy" or "random-greedy"

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
    """``[V]`` int64 counts read from a ``.npy`` file of one non-negative count per token id, which may cover
    fewer ids than V (the rest count 0), never more. ``ValueError`` for an unreadable file, a wrong shape or
    dtype, negative counts or more ids than V."""
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
    out = np.zeros(vocab_size, dtype=np.int64)
    out[: counts.size] = counts
    return out


def balanced_table(counts_V: np.ndarray, num_experts: int, top_k: int, seed: int, rule: str = "greedy") -> torch.Tensor:
    """The ``[V, k]`` ``balanced`` table of the ``[V]`` token counts: k distinct experts per id, loads within
    one count of ``k * total / E``, by ``rule`` (the module docstring; ``seed`` seeds "random-greedy")."""
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
    """The ``[V, k]`` long table of expert ids (k distinct experts per token id) of ``config.hash_type``;
    ``layer_number`` (1-based) seeds ``per_layer`` tables and is ignored otherwise."""
    V, E, k = config.vocab_size, config.num_experts, config.top_k
    if config.hash_type == "mod":
        ids_V1 = torch.arange(V, dtype=torch.long)[:, None]
        return (ids_V1 + torch.arange(k, dtype=torch.long)[None, :]) % E
    seed = config.seed + (layer_number or 0) if config.per_layer else config.seed
    if config.hash_type == "balanced":
        return balanced_table(load_token_counts(config.counts_path, V), E, k, seed, config.balance_rule)
    generator = torch.Generator().manual_seed(seed)
    # argsort of i.i.d. uniforms is a uniform random permutation per row: k distinct experts per id.
    return torch.rand(V, E, generator=generator).argsort(dim=-1)[:, :k].contiguous()


@register_router("hash")
class HashRouter(Router):
    """Hash routing (Roller et al. 2021): token id -> k fixed experts of the persistent buffer ``table``
    ``[V, k]``, each with weight 1/k; no learned gate, no parameters, no aux loss. The output depends on the
    token ids only; the hidden states are read for their number and device alone.

    Token ids outside ``[0, vocab_size)`` raise ``ValueError`` when :attr:`collect_metrics` is set (the range
    is read on the host); otherwise they fail a device-side assert, a ``RuntimeError``, so the forward forces
    no host synchronisation.
    """

    Config = HashConfig
    # ReMoE's Hash baseline, the row the ledger compares the 185M runs with, hashes id mod E (Sec. 4.2).
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
        k = self.top_k
        return RoutingConstraint(RoutingKind.EXACT_K, k, k, top_k=k, probs_sum_to_one=True)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        if token_ids_T is None:
            raise ValueError("hash routing needs token_ids_T")
        if token_ids_T.dtype.is_floating_point or token_ids_T.dtype == torch.bool:
            raise ValueError(f"token_ids_T must be an integer tensor, got {token_ids_T.dtype}")
        V = self.config.vocab_size
        if token_ids_T.numel() and self.collect_metrics:
            lo, hi = int(token_ids_T.min()), int(token_ids_T.max())
            if lo < 0 or hi >= V:
                bad = hi if hi >= V else lo
                raise ValueError(f"token id {bad} is outside [0, vocab_size={V}); set the router's vocab_size")
        elif token_ids_T.numel():
            # The same check without reading the ids on the host: a device-side assert (RuntimeError).
            in_range = ((token_ids_T >= 0) & (token_ids_T < V)).all()
            torch._assert_async(in_range, f"a token id is outside [0, vocab_size={V}); set the router's vocab_size")
        experts_Tk = self.table[token_ids_T.to(self.table.device).long()]
        T, E = hidden_TD.shape[0], self.num_experts
        routing_map_TE = torch.zeros(T, E, dtype=torch.bool, device=hidden_TD.device)
        routing_map_TE.scatter_(1, experts_Tk.to(hidden_TD.device), True)
        probs_TE = routing_map_TE.float() / self.top_k
        metrics = routing_metrics(probs_TE, routing_map_TE) if self.collect_metrics else {}
        return RouterOutput(probs_TE, routing_map_TE, {}, metrics)
