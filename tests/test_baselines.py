"""Tests of the six baseline routers beyond the shared contract (tests/test_router_contract.py).

Switch is checked against megatron-core's own TopKRouter; the others against their papers' formulas
computed here by hand.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import routers
from baselines.hash import HashConfig, balanced_table, build_hash_table
from baselines.lory import segment_means
from baselines.sparsemixer import SparseMixerConfig, sparsemixer_v2_select
from baselines.switch import SwitchConfig

D, E = 32, 8
S, B = 16, 4
T = S * B


def hidden(seed: int = 0, shape: tuple[int, ...] = (T, D)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def build(name: str, hidden_size: int = D, num_experts: int = E, top_k: int = 1, **options):
    """Build a router with its gate drawn from torch seed 0 (``options`` may hold a router's own ``seed``)."""
    torch.manual_seed(0)
    return routers.build_router(name, hidden_size=hidden_size, num_experts=num_experts, top_k=top_k, **options)


def test_all_six_baselines_are_registered():
    assert {"switch", "remoe", "expert_choice", "hash", "lory", "sparsemixer"} <= set(routers.available_routers())


@pytest.mark.parametrize(
    "name, options, field",
    [
        ("switch", {"capacity_factor": 0.0}, "capacity_factor"),
        ("switch", {"drop_policy": "random"}, "drop_policy"),
        ("switch", {"aux_loss_coeff": -1.0}, "aux_loss_coeff"),
        ("switch", {"init_std": 0.0}, "init_std"),
        ("remoe", {"l1_coeff_multiplier": 1.0}, "l1_coeff_multiplier"),
        ("remoe", {"l1_coeff_init": 0.0}, "l1_coeff_init"),
        ("remoe", {"target_sparsity": 1.0}, "target_sparsity"),
        ("expert_choice", {"capacity_factor": -1.0}, "capacity_factor"),
        ("hash", {"hash_type": "md5"}, "hash_type"),
        ("hash", {"vocab_size": 0}, "vocab_size"),
        ("hash", {"seed": -1}, "seed"),
        ("hash", {"hash_type": "balanced"}, "counts_path"),
        ("hash", {"counts_path": "counts.npy"}, "counts_path"),
        ("hash", {"hash_type": "mod", "per_layer": True}, "per_layer"),
        ("lory", {"segment_len": 0}, "segment_len"),
        ("lory", {"first_segment_grad": "all"}, "first_segment_grad"),
        ("sparsemixer", {"jitter_eps": -0.1}, "jitter_eps"),
        ("sparsemixer", {"top_k": 3}, "top_k"),
        ("sparsemixer", {"reference": "phi"}, "reference"),
        ("sparsemixer", {"balance_map": "all"}, "balance_map"),
        ("sparsemixer", {"balance_scope": "model"}, "balance_scope"),
        ("expert_choice", {"eval_capacity_factor": 0.0}, "eval_capacity_factor"),
        ("expert_choice", {"group_size": 0}, "group_size"),
        ("expert_choice", {"group_size": "batch"}, "group_size"),
        ("expert_choice", {"z_loss_coeff": -1.0}, "z_loss_coeff"),
        ("expert_choice", {"reference": "t5x"}, "reference"),
    ],
)
def test_invalid_options_name_the_field(name, options, field):
    top_k = options.pop("top_k", 1)
    with pytest.raises(ValueError, match=field):
        build(name, top_k=top_k, **options)


@pytest.mark.parametrize("name", ["switch", "remoe", "expert_choice", "hash", "lory", "sparsemixer"])
def test_bf16_model_keeps_router_maths_in_float32(name):
    router = build(name).bfloat16().train()
    out = router(hidden().bfloat16(), torch.arange(T), (S, B))
    assert out.probs.dtype == torch.float32
    router.constraint.check(out.routing_map)
    for loss in out.aux_losses.values():
        assert loss.dtype == torch.float32


# --------------------------------------------------------------------------------------------- Switch
@pytest.fixture(scope="module")
def megatron_parallel(tmp_path_factory):
    """torch.distributed (gloo, world size 1) and megatron-core's parallel state, as TopKRouter needs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    created_pg = not dist.is_initialized()
    if created_pg:
        store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    created_mp = not parallel_state.model_parallel_is_initialized()
    if created_mp:
        parallel_state.initialize_model_parallel()
    yield
    if created_mp:
        parallel_state.destroy_model_parallel()
    if created_pg:
        dist.destroy_process_group()


@pytest.fixture
def megatron_cpu(monkeypatch):
    """CPU shims for TopKRouter, megatron's aux-loss scale at 1, and the aux-loss tracker restored after."""
    from megatron.core.transformer.moe import moe_utils

    if not torch.cuda.is_available():
        # TopKRouter.gating moves its weight to torch.cuda.current_device().
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 reads this name even when TransformerEngine is absent.
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    monkeypatch.setattr(moe_utils.MoEAuxLossAutoScaler, "main_loss_backward_scale", torch.tensor(1.0))
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    saved = {k: {**v, "values": v["values"].clone()} for k, v in tracker.items()}
    tracker.clear()
    yield tracker
    tracker.clear()
    tracker.update(saved)


def megatron_router_config(cfg, **router_fields):
    """A one-layer megatron ``TransformerConfig`` of ``cfg``'s sizes, fp32 router on CPU, with ``router_fields``
    (the ``moe_router_*`` / aux-loss fields of the mode compared)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=cfg.hidden_size,
        num_attention_heads=4,
        num_moe_experts=cfg.num_experts,
        moe_ffn_hidden_size=4 * cfg.hidden_size,
        moe_router_topk=cfg.top_k,
        moe_router_dtype="fp32",
        add_bias_linear=False,
        use_cpu_initialization=True,
        **router_fields,
    )


def megatron_config(cfg: SwitchConfig):
    return megatron_router_config(
        cfg,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=cfg.aux_loss_coeff,
        moe_z_loss_coeff=cfg.z_loss_coeff or None,
        moe_router_pre_softmax=cfg.use_pre_softmax,
        moe_expert_capacity_factor=cfg.capacity_factor,
        moe_token_drop_policy=cfg.drop_policy,
    )


@pytest.mark.parametrize(
    "options",
    [
        {"top_k": 1},
        {"top_k": 2, "z_loss_coeff": 1e-3},
        {"top_k": 2, "pre_softmax": True, "capacity_factor": 1.0},
        {"top_k": 4, "pre_softmax": True},
        {"top_k": 1, "capacity_factor": 0.5, "drop_policy": "position"},
    ],
    ids=["top1", "top2-zloss", "top2-presoftmax-capacity", "top4-presoftmax", "top1-capacity-position"],
)
def test_switch_agrees_with_megatron_topk_router(megatron_parallel, megatron_cpu, options):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    tracker = megatron_cpu
    ours = build("switch", **options).train()
    cfg = ours.config
    theirs = TopKRouter(megatron_config(cfg), pg_collection=get_default_pg_collection()).train()
    theirs.set_layer_number(1)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
    hidden_SBD = hidden(1, (S, B, D))
    signal_TE = hidden(2, (T, E))  # a downstream gradient standing in for the experts

    probs_m, map_m = theirs(hidden_SBD)
    (probs_m * signal_TE).sum().backward()  # megatron injects its aux-loss gradients here
    out = ours(hidden_SBD.reshape(T, D), None, (S, B))
    ((out.probs * signal_TE).sum() + out.total_aux_loss()).backward()

    assert torch.equal(out.routing_map, map_m)
    torch.testing.assert_close(out.probs, probs_m.float(), rtol=1e-6, atol=1e-7)
    logged_lb = tracker["load_balancing_loss"]["values"][0] * cfg.aux_loss_coeff
    torch.testing.assert_close(out.aux_losses["load_balancing_loss"].detach(), logged_lb, rtol=1e-6, atol=0)
    if cfg.z_loss_coeff:
        logged_z = tracker["z_loss"]["values"][0] * cfg.z_loss_coeff
        torch.testing.assert_close(out.aux_losses["z_loss"].detach(), logged_z, rtol=1e-6, atol=0)
    else:
        assert "z_loss" not in out.aux_losses and "z_loss" not in tracker
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-8)


def test_switch_top1_needs_pre_softmax_like_megatron():
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match="pre_softmax"):
        build("switch", top_k=1, pre_softmax=False)
    assert SwitchConfig(hidden_size=D, num_experts=E, top_k=1).use_pre_softmax
    assert not SwitchConfig(hidden_size=D, num_experts=E, top_k=2).use_pre_softmax
    # megatron-core 0.16.1 refuses the same config; if it stops refusing, revisit the default.
    with pytest.raises(ValueError, match="pre-softmax"):
        TransformerConfig(
            num_layers=1, hidden_size=D, num_attention_heads=4, num_moe_experts=E, moe_router_topk=1,
            moe_router_pre_softmax=False,
        )


def test_switch_aux_loss_is_alpha_E_sum_f_P_by_hand():
    router = build("switch", top_k=2).train()
    h = hidden(3)
    out = router(h)
    scores_TE = torch.softmax(h @ router.weight.detach().t(), dim=-1)
    top_TE = torch.zeros(T, E, dtype=torch.bool).scatter(1, scores_TE.topk(2, dim=-1).indices, True)
    f_E = top_TE.sum(0) / (T * 2)  # share of the k*T assignments
    P_E = scores_TE.mean(0)
    expected = 1e-2 * E * (f_E * P_E).sum()
    torch.testing.assert_close(out.aux_losses["load_balancing_loss"].detach(), expected)
    assert torch.equal(out.routing_map, top_TE)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(T))  # softmax after top-k for k > 1


@pytest.mark.parametrize("k", [2, 4])
def test_switch_pre_softmax_at_any_k_keeps_the_full_softmax_values(k):
    """ReMoE's dMoE scripts pass --moe-router-pre-softmax: softmax over all E, then the top-k values."""
    router = build("switch", top_k=k, pre_softmax=True).train()
    h = hidden(15)
    out = router(h)
    scores_TE = torch.softmax(h @ router.weight.detach().t(), dim=-1)
    top = scores_TE.topk(k, dim=-1)
    expected = torch.zeros(T, E).scatter(1, top.indices, top.values)
    torch.testing.assert_close(out.probs, expected)
    assert (out.probs.sum(-1) < 1).all()  # not renormalised over the k chosen
    assert not router.constraint.probs_sum_to_one
    default = build("switch", top_k=k).train()(h)  # megatron's default for k > 1: softmax after top-k
    torch.testing.assert_close(default.probs, expected / expected.sum(-1, keepdim=True))


def test_switch_losses_only_when_training_with_grad():
    router = build("switch", z_loss_coeff=1e-3)
    assert set(router.train()(hidden()).aux_losses) == {"load_balancing_loss", "z_loss"}
    assert router.eval()(hidden()).aux_losses == {}
    with torch.no_grad():
        assert router.train()(hidden()).aux_losses == {}


def test_switch_capacity_drops_tokens():
    router = build("switch", capacity_factor=0.5).train()
    out = router(hidden())
    cap = math.ceil(T * 0.5 / E)
    assert int(out.routing_map.sum(0).max()) <= cap
    assert out.metrics["dropped_fraction"] > 0
    router.constraint.check(out.routing_map)


# ---------------------------------------------------------------------------------------------- ReMoE
# Hand example: D = E = 3 and W = I, so the logits are the hidden states.
HAND_H = torch.tensor([[1.0, -1.0, 2.0], [0.5, 3.0, -1.0], [-2.0, -1.0, -3.0], [4.0, 0.0, 1.0]])


def hand_remoe(top_k: int = 1, **options):
    router = build("remoe", hidden_size=3, num_experts=3, top_k=top_k, **options)
    with torch.no_grad():
        router.weight.copy_(torch.eye(3))
    return router


def test_remoe_relu_routing_and_aux_loss_on_a_hand_example():
    router = hand_remoe(l1_coeff_init=0.5).train()
    out = router(HAND_H)
    R = torch.tensor([[1.0, 0.0, 2.0], [0.5, 3.0, 0.0], [0.0, 0.0, 0.0], [4.0, 0.0, 1.0]])
    torch.testing.assert_close(out.probs, R, rtol=0, atol=0)
    assert torch.equal(out.routing_map, R > 0)
    assert out.routing_map[2].sum() == 0  # a token may go to no expert
    # lambda * E / (T^2 k) * sum_e (sum_t R_te)(sum_t 1[R_te > 0]) = 0.5 * 3/16 * (5.5*3 + 3*1 + 3*2)
    torch.testing.assert_close(out.aux_losses["l1_reg_loss"].detach(), torch.tensor(0.5 * 3 / 16 * 25.5))
    assert out.aux_losses["l1_reg_loss"].requires_grad
    torch.testing.assert_close(out.metrics["sparsity"], torch.tensor(0.5))


def test_remoe_coefficient_update_rule():
    router = hand_remoe().train()  # target sparsity 1 - 1/3
    lam0 = torch.tensor(1e-8, dtype=torch.float32)
    assert router.step_statistic() is None
    router(HAND_H)
    router(HAND_H[:2])  # sparsity 1/3
    torch.testing.assert_close(router.step_statistic(), torch.tensor((0.5 + 1 / 3) / 2))
    router.end_step(router.step_statistic())  # too dense (S < 2/3): up by exactly 1.2
    assert router.l1_coeff.dtype == torch.float32
    assert torch.equal(router.l1_coeff, lam0 * 1.2)
    assert math.isclose(float(router.l1_coeff), 1.2e-8, rel_tol=1e-6)
    assert router.step_statistic() is None  # accumulators reset
    router.end_step(torch.tensor(0.9))  # too sparse: down by exactly 1.2
    assert torch.equal(router.l1_coeff, lam0 * 1.2 / 1.2)
    before = router.l1_coeff.clone()
    router.end_step(torch.tensor(1 - 1 / 3, dtype=torch.float64))  # exactly on target: unchanged
    router.end_step(None)  # no training forward: unchanged
    assert torch.equal(router.l1_coeff, before)
    with torch.no_grad():
        router(HAND_H)  # no-grad and eval forwards do not feed the schedule
    router.eval()(HAND_H)
    assert router.step_statistic() is None


def test_remoe_schedule_averages_layers_and_is_checkpointed():
    layers = torch.nn.ModuleList([hand_remoe(top_k=2), hand_remoe(top_k=2)]).train()  # target 1/3
    routers.begin_step(layers, 0)
    layers[0](HAND_H)  # S = 1/2
    layers[1](HAND_H[:2])  # S = 1/3; mean over layers 5/12 > 1/3: too sparse
    averaged = routers.end_step(layers)
    assert math.isclose(averaged["remoe"], 5 / 12, rel_tol=1e-6)
    for layer in layers:
        assert torch.equal(layer.l1_coeff, torch.tensor(1e-8) / 1.2)
    state = layers[0].state_dict()
    assert "l1_coeff" in state and "sparsity_sum" not in state
    fresh = hand_remoe(top_k=2)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.l1_coeff, layers[0].l1_coeff)
    # Casting the model to bf16 (megatron's Float16Module) leaves lambda in float32, unrounded.
    fresh.bfloat16()
    assert fresh.weight.dtype == torch.bfloat16
    assert fresh.l1_coeff.dtype == torch.float32 and torch.equal(fresh.l1_coeff, layers[0].l1_coeff)


# -------------------------------------------------------------------------------------- Expert Choice
def test_expert_choice_each_expert_takes_its_top_C_tokens():
    for options, capacity in (({}, math.ceil(T * 1 / E)), ({"capacity_factor": 2.0}, math.ceil(T * 2 / E))):
        router = build("expert_choice", **options).train()
        h = hidden(4)
        out = router(h)
        scores_TE = torch.softmax(h @ router.weight.detach().t(), dim=-1)
        expected_TE = torch.zeros(T, E, dtype=torch.bool).scatter(0, scores_TE.topk(capacity, dim=0).indices, True)
        assert torch.equal(out.routing_map, expected_TE)
        assert (out.routing_map.sum(0) == capacity).all()
        assert router.constraint.capacity(T, E) == capacity == int(out.metrics["capacity"])
        torch.testing.assert_close(out.probs, scores_TE * expected_TE)
        assert out.aux_losses == {}
    # top_k = 2 defaults to c = 2
    assert build("expert_choice", top_k=2).capacity(T) == math.ceil(T * 2 / E)


def test_expert_choice_routing_depends_on_later_tokens():
    """The causal leakage the docstring declares: changing the last token re-routes earlier tokens."""
    router = build("expert_choice").eval()
    h = hidden(5)
    before = router(h).routing_map
    h2 = h.clone()
    h2[-1] = 50 * router.weight.detach()[0]  # the last token now scores highest for expert 0
    after = router(h2).routing_map
    assert after[-1, 0]
    assert not torch.equal(before[:-1], after[:-1])


def _ec_by_hand(scores_TE: torch.Tensor, groups: list[list[int]], capacity: int) -> torch.Tensor:
    """flaxformer's expert choice written out: per group, each expert's top-C tokens."""
    map_TE = torch.zeros_like(scores_TE, dtype=torch.bool)
    for tokens in groups:
        idx = torch.tensor(tokens)
        top = scores_TE[idx].topk(capacity, dim=0).indices  # [C, E] positions inside the group
        for e in range(scores_TE.shape[1]):
            map_TE[idx[top[:, e]], e] = True
    return map_TE


def test_expert_choice_sequence_groups_choose_within_each_sequence():
    router = build("expert_choice", group_size="sequence").train()
    h = hidden(16)
    out = router(h, None, (S, B))
    scores_TE = torch.softmax(h @ router.weight.detach().t(), dim=-1)
    groups = [[s * B + b for s in range(S)] for b in range(B)]  # megatron order t = s * B + b
    capacity = math.ceil(S * 1 / E)
    expected = _ec_by_hand(scores_TE, groups, capacity)
    assert torch.equal(out.routing_map, expected)
    for tokens in groups:
        assert (out.routing_map[tokens].sum(0) == capacity).all()
    assert (int(out.metrics["group_size"]), int(out.metrics["num_groups"]), int(out.metrics["capacity"])) == (S, B, capacity)
    torch.testing.assert_close(out.probs, scores_TE * expected)


def test_expert_choice_sequence_groups_do_not_depend_on_other_sequences_or_batch_size():
    router = build("expert_choice", group_size="sequence").eval()
    h_SBD = hidden(17, (S, B, D))
    full = router(h_SBD.reshape(T, D), None, (S, B)).routing_map.view(S, B, E)
    alone = router(h_SBD[:, :1].reshape(S, D), None, (S, 1)).routing_map.view(S, 1, E)
    assert torch.equal(full[:, 0], alone[:, 0])  # the same sequence routes the same in a batch of 1
    h2 = h_SBD.clone()
    h2[:, 1:] = hidden(18, (S, B - 1, D))
    changed = router(h2.reshape(T, D), None, (S, B)).routing_map.view(S, B, E)
    assert torch.equal(changed[:, 0], full[:, 0])
    # ... while the micro-batch group (the default) lets the other sequences re-route sequence 0.
    batch_router = build("expert_choice").eval()
    a = batch_router(h_SBD.reshape(T, D), None, (S, B)).routing_map.view(S, B, E)
    b = batch_router(h2.reshape(T, D), None, (S, B)).routing_map.view(S, B, E)
    assert not torch.equal(a[:, 0], b[:, 0])


def test_expert_choice_fixed_group_size_and_flaxformer_group_count():
    from baselines.expert_choice import num_groups

    assert num_groups(64, 16) == 4 and num_groups(64, 24) == 4 and num_groups(60, 16) == 4 and num_groups(7, 2) == 7
    router = build("expert_choice", group_size=32, capacity_factor=2.0).train()
    h = hidden(19)
    out = router(h, None, (S, B))
    scores_TE = torch.softmax(h @ router.weight.detach().t(), dim=-1)
    batch_major = [s * B + b for b in range(B) for s in range(S)]
    groups = [batch_major[:32], batch_major[32:]]  # 32 consecutive tokens: two sequences of 16
    assert torch.equal(out.routing_map, _ec_by_hand(scores_TE, groups, math.ceil(32 * 2 / E)))
    assert int(out.metrics["group_size"]) == 32


def test_expert_choice_eval_capacity_factor_and_z_loss():
    router = build("expert_choice", eval_capacity_factor=2.0, z_loss_coeff=1e-3)
    h = hidden(20)
    train_out = router.train()(h)
    assert (train_out.routing_map.sum(0) == math.ceil(T / E)).all()
    logits = h @ router.weight.detach().t()
    expected_z = 1e-3 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(train_out.aux_losses["z_loss"].detach(), expected_z)
    assert train_out.aux_losses["z_loss"].requires_grad
    eval_out = router.eval()(h)
    assert (eval_out.routing_map.sum(0) == math.ceil(2 * T / E)).all() and eval_out.aux_losses == {}
    assert router.capacity(T, training=True) == math.ceil(T / E)


# ----------------------------------------------------------------------------------------------- Hash
def test_hash_output_depends_only_on_token_ids():
    router = build("hash", vocab_size=100).train()
    ids_T = torch.randint(0, 100, (T,), generator=torch.Generator().manual_seed(0))
    a, b = router(hidden(0), ids_T), router(hidden(1), ids_T)
    assert torch.equal(a.routing_map, b.routing_map) and torch.equal(a.probs, b.probs)
    c = router(hidden(0), (ids_T + 1) % 100)
    assert not torch.equal(a.routing_map, c.routing_map)
    torch.testing.assert_close(a.probs, a.routing_map.float())  # weight 1 for k = 1
    assert torch.equal(a.routing_map.float().argmax(-1), router.table[ids_T, 0])
    assert a.aux_losses == {} and list(router.parameters()) == []


def test_hash_mod_variant_is_id_mod_E():
    ids_T = torch.arange(T) * 7
    out = build("hash", hash_type="mod", vocab_size=1000)(hidden(), ids_T)
    assert torch.equal(out.routing_map, torch.nn.functional.one_hot(ids_T % E, E).bool())
    out2 = build("hash", hash_type="mod", vocab_size=1000, top_k=2)(hidden(), ids_T)
    expected = torch.nn.functional.one_hot(ids_T % E, E) + torch.nn.functional.one_hot((ids_T + 1) % E, E)
    assert torch.equal(out2.routing_map, expected.bool())


def test_hash_seeded_table_and_top_k_distinct():
    cfg = dict(hidden_size=D, num_experts=E, vocab_size=500)
    t1 = build_hash_table(HashConfig(**cfg, seed=1))
    assert torch.equal(t1, build_hash_table(HashConfig(**cfg, seed=1)))
    assert not torch.equal(t1, build_hash_table(HashConfig(**cfg, seed=2)))
    assert 0 <= int(t1.min()) and int(t1.max()) < E and len(t1.unique()) == E
    t3 = build_hash_table(HashConfig(**cfg, top_k=3))
    assert all(len(set(row.tolist())) == 3 for row in t3)
    router = build("hash", top_k=3, vocab_size=500)
    out = router(hidden(), torch.arange(T))
    assert (out.routing_map.sum(-1) == 3).all()
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(T))


def test_hash_table_is_checkpointed_and_ids_are_checked():
    src, dst = build("hash", seed=1, vocab_size=100), build("hash", seed=2, vocab_size=100)
    assert "table" in src.state_dict()
    dst.load_state_dict(src.state_dict())
    ids_T = torch.arange(T)
    assert torch.equal(src(hidden(), ids_T).routing_map, dst(hidden(), ids_T).routing_map)
    with pytest.raises(ValueError, match="vocab_size"):
        src(hidden(), torch.full((T,), 100))
    with pytest.raises(ValueError, match="token_ids"):
        src(hidden(), None)


def _zipf_counts(V: int = 1000, seed: int = 0) -> np.ndarray:
    """A Zipfian corpus whose most frequent id holds about half an expert's equal share at k = 1."""
    rng = np.random.default_rng(seed)
    counts = (10_000 / np.arange(1, V + 1) ** 0.8).astype(np.int64)
    counts[rng.choice(V, 20, replace=False)] = 0  # ids never seen in the corpus
    return rng.permutation(counts)


@pytest.mark.parametrize("rule", ["greedy", "random-greedy"])
@pytest.mark.parametrize("k", [1, 2])
def test_hash_balanced_table_balances_the_corpus_load(k, rule):
    counts = _zipf_counts()
    table = balanced_table(counts, E, k, seed=3, rule=rule)
    assert table.shape == (1000, k) and all(len(set(row.tolist())) == k for row in table)
    load_E = np.zeros(E, dtype=np.int64)
    for token, experts in enumerate(table.tolist()):
        load_E[experts] += counts[token]
    ideal = k * counts.sum() / E
    assert load_E.max() <= math.ceil(ideal) + counts.max()  # the greedy bound
    assert load_E.max() / ideal < 1.05  # and in fact close to an equal share
    random_table = build_hash_table(HashConfig(hidden_size=D, num_experts=E, top_k=k, vocab_size=1000))
    random_load = np.zeros(E, dtype=np.int64)
    for token, experts in enumerate(random_table.tolist()):
        random_load[experts] += counts[token]
    assert load_E.max() < random_load.max()  # balancing beats the random map on a Zipfian corpus
    # Unseen ids are spread round-robin; the table is a function of the seed.
    unseen = np.flatnonzero(counts == 0)
    assert np.bincount(table[unseen].reshape(-1).numpy(), minlength=E).max() <= math.ceil(len(unseen) * k / E)
    assert torch.equal(table, balanced_table(counts, E, k, seed=3, rule=rule))
    # The paper's greedy draws nothing; the randomised rule is a function of the seed.
    assert torch.equal(table, balanced_table(counts, E, k, seed=4, rule=rule)) == (rule == "greedy")


def test_hash_balanced_router_reads_counts_and_checkpoints_its_table(tmp_path):
    counts = _zipf_counts()
    path = tmp_path / "counts.npy"
    np.save(path, counts[:900])  # fewer ids than the vocabulary: the rest count 0
    router = build("hash", hash_type="balanced", counts_path=str(path), vocab_size=1000)
    padded = np.concatenate([counts[:900], np.zeros(100, np.int64)])
    assert torch.equal(router.table, balanced_table(padded, E, 1, seed=42))
    ids_T = torch.arange(T) * 4
    out = router(hidden(), ids_T)
    assert torch.equal(out.routing_map, torch.nn.functional.one_hot(router.table[ids_T, 0], E).bool())
    # The table travels in the state dict: a router built from other counts routes as the saved one.
    np.save(tmp_path / "other.npy", np.ones(1000, np.int64))
    other = build("hash", hash_type="balanced", counts_path=str(tmp_path / "other.npy"), vocab_size=1000)
    other.load_state_dict(router.state_dict())
    assert torch.equal(other(hidden(), ids_T).routing_map, out.routing_map)
    np.save(tmp_path / "bad.npy", np.ones(1001, np.int64))
    with pytest.raises(ValueError, match="vocab_size"):
        build("hash", hash_type="balanced", counts_path=str(tmp_path / "bad.npy"), vocab_size=1000)


def test_hash_per_layer_tables_through_megatrons_layer_number():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from routers.megatron_adapter import MegatronRouterAdapter

    config = TransformerConfig(
        num_layers=2, hidden_size=D, num_attention_heads=4, num_moe_experts=E, moe_router_topk=1,
        moe_router_pre_softmax=True,
    )
    adapters = []
    for layer in (1, 2):
        adapter = MegatronRouterAdapter(config=config, router_name="hash", router_options={"per_layer": True, "vocab_size": 500})
        adapter.set_layer_number(layer)  # what megatron's MoELayer does at construction
        adapters.append(adapter)
    t1, t2 = adapters[0].router.table, adapters[1].router.table
    cfg = adapters[0].router.config
    assert torch.equal(t1, build_hash_table(cfg, 1)) and torch.equal(t2, build_hash_table(cfg, 2))
    assert torch.equal(t1, build_hash_table(dataclasses.replace(cfg, per_layer=False, seed=43)))  # seed + layer
    assert not torch.equal(t1, t2)
    shared = MegatronRouterAdapter(config=config, router_name="hash", router_options={"vocab_size": 500})
    shared.set_layer_number(2)
    assert shared.layer_number == 2
    assert torch.equal(shared.router.table, build_hash_table(dataclasses.replace(cfg, per_layer=False)))  # default: one table


# ----------------------------------------------------------------------------------------------- Lory
LORY_S, LORY_B, LORY_L = 10, 2, 4  # segments of 4, 4 and a partial 2


def test_lory_segment_g_is_routed_by_segment_g_minus_1():
    router = build("lory", segment_len=LORY_L).train()
    h_SBD = hidden(6, (LORY_S, LORY_B, D))
    w = router.segment_weights(h_SBD.reshape(-1, D), (LORY_S, LORY_B)).detach()
    assert w.shape == (LORY_B, 3, E)
    W = router.weight.detach()
    for b in range(LORY_B):
        seg = [h_SBD[0:4, b].mean(0), h_SBD[4:8, b].mean(0), h_SBD[8:10, b].mean(0)]
        torch.testing.assert_close(w[b, 0], torch.softmax(W @ seg[0], -1))  # first: itself
        torch.testing.assert_close(w[b, 1], torch.softmax(W @ seg[0], -1))
        torch.testing.assert_close(w[b, 2], torch.softmax(W @ seg[1], -1))
    # Perturbing segment 1 of sequence 0 leaves its own weights (and segment 0's) unchanged, changes
    # segment 2's, and leaves sequence 1 alone.
    h2_SBD = h_SBD.clone()
    h2_SBD[4:8, 0] += 3.0 * torch.randn(4, D, generator=torch.Generator().manual_seed(7))
    w2 = router.segment_weights(h2_SBD.reshape(-1, D), (LORY_S, LORY_B)).detach()
    torch.testing.assert_close(w2[0, :2], w[0, :2], rtol=0, atol=0)
    assert not torch.allclose(w2[0, 2], w[0, 2])
    torch.testing.assert_close(w2[1], w[1], rtol=0, atol=0)


@pytest.mark.parametrize("first_segment_grad", ["none", "router"])
def test_lory_first_segment_stop_gradient(first_segment_grad):
    """Paper (Sec. 3.1, Algorithm 1: e[:, 0] = stop_grad(e_first)): nothing learns from segment 0's routing."""
    router = build("lory", segment_len=LORY_L, first_segment_grad=first_segment_grad).train()
    h_TD = hidden(8, (LORY_S * LORY_B, D)).requires_grad_(True)
    w = router.segment_weights(h_TD, (LORY_S, LORY_B))
    (w[:, 0] * hidden(9, (LORY_B, E))).sum().backward()
    assert h_TD.grad.abs().sum() == 0  # segment 0's routing never trains its own hidden states
    if first_segment_grad == "none":
        assert router.weight.grad is None or router.weight.grad.abs().sum() == 0
    else:
        assert router.weight.grad.abs().sum() > 0  # the suite's earlier reading: W_r learns from it
    # The later segments train W_r and the previous segment's hidden states either way.
    router.weight.grad = None
    h_TD.grad = None
    w = router.segment_weights(h_TD, (LORY_S, LORY_B))
    (w[:, 1] * hidden(9, (LORY_B, E))).sum().backward()
    assert router.weight.grad.abs().sum() > 0 and h_TD.grad.abs().sum() > 0
    # The forward is the same for both settings.
    other = build("lory", segment_len=LORY_L, first_segment_grad="router" if first_segment_grad == "none" else "none")
    torch.testing.assert_close(other.segment_weights(h_TD.detach(), (LORY_S, LORY_B)), w.detach())


def test_lory_partial_segments_averaged():
    router = build("lory", segment_len=LORY_L).train()
    h_TD = hidden(8, (LORY_S * LORY_B, D))
    # The partial last segment is averaged over its own 2 tokens.
    means = segment_means(h_TD, (LORY_S, LORY_B), LORY_L)
    torch.testing.assert_close(means[1, 2], h_TD.view(LORY_S, LORY_B, D)[8:10, 1].mean(0))
    # A sequence shorter than one segment routes on itself (detached), and seq_shape None is one sequence.
    short = router.segment_weights(h_TD[:3], None)
    torch.testing.assert_close(short[0, 0], torch.softmax(router.weight.detach() @ h_TD[:3].mean(0), -1))


def test_lory_probs_give_every_token_its_segment_weights():
    router = build("lory", segment_len=LORY_L).train()
    h_TD = hidden(10, (LORY_S * LORY_B, D))
    out = router(h_TD, None, (LORY_S, LORY_B))
    w = router.segment_weights(h_TD, (LORY_S, LORY_B))
    for s in range(LORY_S):
        for b in range(LORY_B):
            torch.testing.assert_close(out.probs[s * LORY_B + b], w[b, s // LORY_L])
    assert out.routing_map.all() and out.aux_losses == {}
    assert int(out.metrics["num_segments"]) == 3


# ------------------------------------------------------------------------------------- SparseMixer-v2
def jitter_mask(logits_TE: torch.Tensor, eps: float, exclude_TE: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's mask, written out: (best - l_i) / max(|l_i|, best) > 2 eps, best over the candidates."""
    candidates = logits_TE if exclude_TE is None else logits_TE.masked_fill(exclude_TE, float("-inf"))
    best_T1 = candidates.max(-1, keepdim=True).values
    mask = (best_T1 - logits_TE) / torch.maximum(logits_TE.abs(), best_T1) > 2 * eps
    return mask if exclude_TE is None else mask | exclude_TE


def test_sparsemixer_top1_forward_and_backward_match_the_formulas():
    eps = 0.1
    logits_TE = (hidden(11, (256, E)) * 0.3 + 1.0).requires_grad_(True)
    torch.manual_seed(0)
    weight_T, sel_T, pi_TE, scale_T = sparsemixer_v2_select(logits_TE, eps, training=True)
    lg = logits_TE.detach()
    mask_TE = jitter_mask(lg, eps)
    assert mask_TE.any() and (~mask_TE).sum(-1).min() >= 1
    pi_ref_TE = torch.softmax(lg.masked_fill(mask_TE, float("-inf")), -1)
    torch.testing.assert_close(pi_TE, pi_ref_TE)
    assert not mask_TE.gather(1, sel_T[:, None]).any()  # never samples a masked expert
    is_top_T = sel_T == pi_ref_TE.argmax(-1)
    assert (~is_top_T).any()  # Gumbel sampling did pick non-argmax experts
    assert (scale_T[is_top_T] == 1).all()
    assert set(scale_T[~is_top_T].tolist()) <= {1.0, float(torch.tensor(1 / 3))}
    pi_sel_T = pi_ref_TE.gather(1, sel_T[:, None]).squeeze(1)
    torch.testing.assert_close(weight_T.detach(), pi_sel_T * scale_T)
    # Backward: g * pi_i * (e_i - pi), whatever the forward's Heun scale.
    g_T = hidden(12, (256,))
    (weight_T * g_T).sum().backward()
    onehot_TE = torch.nn.functional.one_hot(sel_T, E).float()
    expected_TE = (g_T * pi_sel_T)[:, None] * (onehot_TE - pi_ref_TE)
    torch.testing.assert_close(logits_TE.grad, expected_TE)


def test_sparsemixer_sampling_follows_masked_softmax_and_heun_mixing():
    N = 20000
    row = torch.tensor([1.0, 0.95, 0.9, 0.2])  # the last one is beyond the jitter threshold
    logits_TE = row.expand(N, 4).clone()
    torch.manual_seed(1)
    _, sel_T, pi_TE, scale_T = sparsemixer_v2_select(logits_TE, 0.1, training=True)
    pi = torch.softmax(torch.tensor([1.0, 0.95, 0.9]), -1)
    freq = torch.bincount(sel_T, minlength=4).float() / N
    assert freq[3] == 0
    torch.testing.assert_close(freq[:3], pi, rtol=0, atol=0.015)
    full_share = (scale_T[sel_T != 0] == 1).float().mean()
    assert abs(float(full_share) - 0.25) < 0.02  # kept whole w.p. 1/4, else scaled to 1/3
    # Evaluation: arg-max, full weight, no randomness.
    w_eval, sel_eval, _, scale_eval = sparsemixer_v2_select(logits_TE[:8], 0.1, training=False)
    assert (sel_eval == 0).all() and (scale_eval == 1).all()
    torch.testing.assert_close(w_eval, torch.full((8,), float(pi[0])))


def test_sparsemixer_top2_router_backward_sums_both_estimators():
    eps = 0.1
    router = build("sparsemixer", hidden_size=E, top_k=2, aux_loss_coeff=0.0, jitter_eps=eps).eval()  # arg-max
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))  # logits = hidden
    h_TE = (hidden(13, (T, E)) * 0.2 + 1.0).requires_grad_(True)
    out = router(h_TE)
    signal_TE = hidden(14, (T, E))
    (out.probs * signal_TE).sum().backward()

    lg = h_TE.detach()
    mask1 = jitter_mask(lg, eps)
    pi1 = torch.softmax(lg.masked_fill(mask1, float("-inf")), -1)
    sel1 = lg.argmax(-1)
    first = torch.nn.functional.one_hot(sel1, E).bool()
    mask2 = jitter_mask(lg, eps, exclude_TE=first)
    pi2 = torch.softmax(lg.masked_fill(mask2, float("-inf")), -1)
    sel2 = lg.masked_fill(first, float("-inf")).argmax(-1)
    expected_map = first | torch.nn.functional.one_hot(sel2, E).bool()
    assert torch.equal(out.routing_map, expected_map)
    rows = torch.arange(T)
    torch.testing.assert_close(out.probs[rows, sel1], pi1[rows, sel1])
    torch.testing.assert_close(out.probs[rows, sel2], pi2[rows, sel2])
    grad = torch.zeros(T, E)
    for sel, pi in ((sel1, pi1), (sel2, pi2)):
        g_T = signal_TE[rows, sel] * pi[rows, sel]
        grad += g_T[:, None] * (torch.nn.functional.one_hot(sel, E).float() - pi)
    torch.testing.assert_close(h_TE.grad, grad)


def test_sparsemixer_defaults_follow_grin_and_the_repository_setting_is_one_flag_away():
    grin = SparseMixerConfig(hidden_size=D, num_experts=E)
    assert (grin.effective_jitter_eps, grin.effective_aux_loss_coeff, grin.effective_balance_map) == (0.01, 1e-3, "topk")
    assert grin.effective_balance_scope == "pooled"
    repo = SparseMixerConfig(hidden_size=D, num_experts=E, reference="sparsemixer-repo")
    assert (repo.effective_jitter_eps, repo.effective_aux_loss_coeff, repo.effective_balance_map) == (0.1, 1e-2, "sampled")
    assert repo.effective_balance_scope == "per-layer"
    mixed = SparseMixerConfig(hidden_size=D, num_experts=E, reference="sparsemixer-repo", jitter_eps=0.05)
    assert (mixed.effective_jitter_eps, mixed.effective_aux_loss_coeff) == (0.05, 1e-2)  # a field overrides


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("reference", ["grin", "sparsemixer-repo"])
def test_sparsemixer_balance_loss_counts_the_documented_experts(k, reference):
    router = build("sparsemixer", top_k=k, reference=reference).train()
    h = hidden(21) * 30  # spread logits, so sampling often differs from the arg-max
    torch.manual_seed(5)
    out = router(h)
    scores_TE = torch.softmax(h @ router.weight.detach().t(), dim=-1)
    if reference == "grin":
        map_TE = torch.zeros(T, E, dtype=torch.bool).scatter(1, scores_TE.topk(k, dim=-1).indices, True)
        alpha = 1e-3
    else:
        map_TE = out.routing_map
        alpha = 1e-2
    f_E = map_TE.sum(0) / (T * k)
    expected = alpha * E * (f_E * scores_TE.mean(0)).sum()
    torch.testing.assert_close(out.aux_losses["load_balancing_loss"].detach(), expected)
    assert float(out.metrics["sampled_not_argmax"]) > 0  # the two maps really differ in this test


def test_sparsemixer_only_top1_and_top2():
    assert SparseMixerConfig(hidden_size=D, num_experts=E, top_k=2).top_k == 2
    with pytest.raises(ValueError, match="top_k"):
        SparseMixerConfig(hidden_size=D, num_experts=E, top_k=3)
