"""The baselines' published reference rules, one option away from each other: Hash Layers' balanced
assignment, flaxformer's Expert Choice capacity and groups, GRIN's pooled SparseMixer-v2 balancing loss.
(Lory's dense start is tested with its merge layer, tests/test_model.py, and in training, tests/test_training.py.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_baselines import B, D, E, S, T, _ec_by_hand, build, hidden

from baselines.hash import HashConfig, balanced_table


# ------------------------------------------------------------------------------------ Hash
def test_hash_balanced_greedy_follows_the_papers_rule_on_a_small_table():
    # Ids by frequency: 3 (9), 0 (7), 4 (5), 1 (4), 2 (2), 5 (1); id 6 never seen. E = 3 buckets, k = 1.
    counts = np.array([7, 4, 2, 9, 5, 1, 0], dtype=np.int64)
    table = balanced_table(counts, 3, 1, seed=0)
    # Loads (0,0,0): 3->0 (9,0,0); 0->1 (9,7,0); 4->2 (9,7,5); 1->2 (9,7,9); 2->1 (9,9,9); 5->0 (10,9,9).
    assert table[:, 0].tolist()[:6] == [1, 2, 1, 0, 2, 0]
    assert table[6, 0] == 0  # the first unseen id, round-robin from expert 0
    assert torch.equal(table, balanced_table(counts, 3, 1, seed=123))  # nothing is drawn
    # k = 2: the two emptiest, distinct. 3 -> {0, 1} (9,9,0); 0 -> {2, 0} (16,9,7); 4 -> {2, 1} (16,14,12).
    table2 = balanced_table(counts, 3, 2, seed=0)
    assert [sorted(r) for r in table2[[3, 0, 4]].tolist()] == [[0, 1], [0, 2], [1, 2]]
    # The earlier randomised rule is the named alternative, seeded.
    rand = balanced_table(counts, 3, 1, seed=5, rule="random-greedy")
    assert torch.equal(rand, balanced_table(counts, 3, 1, seed=5, rule="random-greedy"))
    cfg = HashConfig(hidden_size=D, num_experts=E, hash_type="balanced", counts_path="x.npy")
    assert cfg.balance_rule == "greedy"
    with pytest.raises(ValueError, match="balance_rule"):
        HashConfig(hidden_size=D, num_experts=E, hash_type="balanced", counts_path="x.npy", balance_rule="x")


# ---------------------------------------------------------------------------- Expert Choice
@pytest.mark.parametrize(
    "g, c, E_, megatron, flaxformer",
    [
        (512, 1.0, 8, 64, 64),  # E divides g c: the two agree
        (100, 1.0, 8, 13, 12),  # 12.5: megatron's ceil 13, flaxformer's round half to even 12
        (104, 1.0, 16, 7, 6),  # 6.5 -> 7 / 6
        (56, 2.0, 16, 7, 7),  # 7.0
        (20, 1.0, 8, 3, 4),  # 2.5: flaxformer's minimum of 4
        (3, 1.0, 8, 1, 3),  # the minimum capped at the group
        (1000, 1.25, 64, 20, 20),  # 19.53 -> 20 / 20
    ],
)
def test_expert_choice_capacity_per_reference(g, c, E_, megatron, flaxformer):
    from baselines.expert_choice import group_capacity

    assert group_capacity(g, c, E_, 1, "megatron") == megatron == min(g, math.ceil(g * c / E_))
    assert group_capacity(g, c, E_, 1, "flaxformer") == flaxformer == min(g, max(round(c * g / E_), 4))
    router = build("expert_choice", num_experts=E_, capacity_factor=c, reference="flaxformer")
    assert router.capacity(g, training=True) == flaxformer


def test_expert_choice_flaxformer_groups_and_constraint():
    from baselines.expert_choice import num_groups

    # flaxformer's _num_groups: at least E groups, a multiple of E dividing T (or T itself).
    assert num_groups(64, 64, "flaxformer", 8) == 8 and num_groups(64, 4, "flaxformer", 8) == 16
    assert num_groups(96, 1000, "flaxformer", 8) == 8 and num_groups(40, 40, "flaxformer", 16) == 40
    with pytest.raises(ValueError, match="multiple of 16"):
        num_groups(12, 12, "flaxformer", 16)
    router = build("expert_choice", reference="flaxformer").train()
    h = hidden(21)
    out = router(h, None, (S, B))
    # T = 64, E = 8: 8 groups of 8 consecutive tokens (half a sequence); C = max(round(8 / 8), 4) = 4.
    scores_TE = torch.softmax(h @ router.weight.detach().t(), dim=-1)
    batch_major = [s * B + b for b in range(B) for s in range(S)]
    groups = [batch_major[i : i + 8] for i in range(0, T, 8)]
    assert torch.equal(out.routing_map, _ec_by_hand(scores_TE, groups, 4))
    assert (int(out.metrics["num_groups"]), int(out.metrics["capacity"])) == (8, 4)
    # The declared constraint reports the N * C tokens each expert takes, per reference.
    assert router.constraint.capacity(T, E) == 8 * 4
    router.constraint.check(out.routing_map)
    megatron_groups = build("expert_choice", group_size=24).train()  # 64 tokens: n >= 64 / 24 dividing 64 is 4
    out = megatron_groups(h, None, (S, B))
    assert megatron_groups.constraint.capacity(T, E) == 4 * math.ceil(16 / E) == int(out.routing_map.sum(0)[0])
    megatron_groups.constraint.check(out.routing_map)
    assert build("expert_choice").constraint.capacity(T, E) == math.ceil(T / E)  # the default: one group


# ---------------------------------------------------------------------------- SparseMixer-v2


def _linked_sparsemixers(L: int, k: int, same: bool, **options):
    """L SparseMixer routers of one model (linked as the builder links them), layers 1..L, in training."""
    from baselines.sparsemixer import SparseMixerRouter

    layers = []
    for layer in range(1, L + 1):
        router = build("sparsemixer", top_k=k, **options).train()
        if not same:
            with torch.no_grad():
                router.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(layer))
        router.set_layer_number(layer)
        layers.append(router)
    SparseMixerRouter.link_layers(layers)
    return layers


@pytest.mark.parametrize("k", [1, 2])
def test_sparsemixer_pooled_balance_loss_is_grins_loss_over_all_layers(k):
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    L, alpha = 3, 1e-3
    layers = _linked_sparsemixers(L, k, same=False)
    hs = [hidden(30 + layer) for layer in range(L)]
    torch.manual_seed(0)
    outs = [router(h) for router, h in zip(layers, hs)]
    # Only the forward's last layer carries the loss: the whole pooled loss.
    assert [("load_balancing_loss" in o.aux_losses) for o in outs] == [False] * (L - 1) + [True]
    pooled = outs[-1].aux_losses["load_balancing_loss"]
    # By hand: GRIN concatenates the layers' logits, [L T, E], and takes one loss on them (megatron's 1/(kT)).
    logits = [h @ r.weight.detach().t() for r, h in zip(layers, hs)]
    scores_NE = torch.softmax(torch.cat(logits), dim=-1)
    map_NE = torch.zeros(L * T, E, dtype=torch.bool).scatter(1, scores_NE.topk(k, dim=-1).indices, True)
    f_E, P_E = map_NE.sum(0) / (L * T * k), scores_NE.mean(0)
    torch.testing.assert_close(pooled.detach(), alpha * E * (f_E * P_E).sum())
    # It is not the sum (nor the mean) of the per-layer losses: the layers' counts and probabilities cross.
    per_layer = [
        switch_load_balancing_loss_func(torch.softmax(z, -1), m.sum(0), T, k, E, alpha)
        for z, m in zip(logits, map_NE.view(L, T, E))
    ]
    value = float(pooled.detach())
    assert abs(value - float(sum(per_layer).detach()) / L) > 1e-4 * value
    # Gradient: d pooled / d logits_m = (1 / L) alpha E sum_e fbar_e dP_me, fbar the pooled counts: 1/L of
    # the per-layer loss's gradient with layer m's counts replaced by the layers' mean counts.
    pooled.backward()
    counts_mean_E = map_NE.sum(0).float() / L
    for router, h in zip(layers, hs):
        w = router.weight.detach().clone().requires_grad_(True)
        ref = switch_load_balancing_loss_func(torch.softmax(h @ w.t(), -1), counts_mean_E, T, k, E, alpha) / L
        ref.backward()
        torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-5, atol=1e-12)
    # The pool starts again for the next forward; evaluation and no-grad forwards add nothing.
    with torch.no_grad():
        assert all("load_balancing_loss" not in r(h).aux_losses for r, h in zip(layers, hs))
    assert [("load_balancing_loss" in r(h).aux_losses) for r, h in zip(layers, hs)] == [False] * (L - 1) + [True]


def test_sparsemixer_per_layer_scope_balances_L_times_as_hard():
    L = 3
    # The same weights and inputs in every layer: equal counts, where the two scopes' gradients differ by L.
    pooled = _linked_sparsemixers(L, 1, same=True)
    per_layer = _linked_sparsemixers(L, 1, same=True, balance_scope="per-layer")
    h = hidden(40)
    for routers_ in (pooled, per_layer):
        losses = [loss for r in routers_ for loss in r(h).aux_losses.values()]
        sum(losses).backward()
    per_layer_losses = [r(h).aux_losses["load_balancing_loss"] for r in per_layer]
    assert len(per_layer_losses) == L  # one loss per layer, each weighted by alpha
    for a, b in zip(pooled, per_layer):
        scale = float(b.weight.grad.abs().max())
        assert scale > 0
        torch.testing.assert_close(b.weight.grad, L * a.weight.grad, rtol=1e-5, atol=1e-6 * scale)
    # The repository's setting is per layer; a router used alone pools its one layer (the per-layer loss).
    assert build("sparsemixer", reference="sparsemixer-repo").config.effective_balance_scope == "per-layer"
    alone = build("sparsemixer").train()
    single = build("sparsemixer", balance_scope="per-layer").train()
    torch.testing.assert_close(alone(h).aux_losses["load_balancing_loss"], single(h).aux_losses["load_balancing_loss"])
