"""Model flavours, the megatron-core model builder, the router adapter and Lory's merging layer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import routers
from baselines.lory_layer import LoryMoELayer, lory_merged_ffn
from repro.flavours import available_flavours, get_flavour
from repro.model.builder import MEGATRON_ROUTER, build_model, causal_attention_mask, transformer_config
from repro.model.parallel import destroy_distributed, init_distributed
from routers.base import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind
from routers.megatron_adapter import (
    MegatronRouterAdapter,
    collect_aux_losses,
    collect_routing_metrics,
    prompt_routing,
    reset_routing_stats,
    router_adapters,
    token_ids_context,
)
from routers.metrics import routing_metrics
from routers.schedule import routers_in

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

VOCAB, SEQ, BATCH = 100, 16, 2
SPY = "test-token-id-spy"  # a test-only router, registered by the `spy_router` fixture


@pytest.fixture(scope="module", autouse=True)
def distributed():
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    # Torn down after the module: other suites start their own process groups, and megatron's aux-loss
    # tracker (process-global) must not keep entries that name this module's process groups.
    yield init_distributed(tp=1, ep=1, seed=1)
    get_moe_layer_wise_logging_tracker().clear()
    destroy_distributed()


def make_batch(seed: int = 0, seq: int = SEQ, batch: int = BATCH):
    g = torch.Generator().manual_seed(seed)
    ids_BS = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels_BS = torch.randint(0, VOCAB, (batch, seq), generator=g)
    pos_BS = torch.arange(seq)[None].expand(batch, seq)
    return ids_BS, pos_BS, causal_attention_mask(seq), labels_BS


def tiny(router_name=None, router_options=None, seed: int = 0, flavour: str = "tiny"):
    return build_model(flavour, router_name, router_options, vocab_size=VOCAB, seq_length=SEQ, seed=seed)


def lm_loss(model, seed: int = 0) -> torch.Tensor:
    ids_BS, pos_BS, mask, labels_BS = make_batch(seed)
    with token_ids_context(model, ids_BS):
        return model(ids_BS, pos_BS, mask, labels=labels_BS).mean()


# ------------------------------------------------------------------------ a test-only router
@dataclass(frozen=True)
class SpyConfig(RouterConfig):
    aux_coeff: float = 0.0


class SpyRouter(Router):
    """Routes token id mod E with a sigmoid weight, records the ids it sees, aux loss aux_coeff * |W|^2."""

    Config = SpyConfig
    requires_token_ids = True

    def __init__(self, config: SpyConfig) -> None:
        super().__init__(config)
        self.weight = torch.nn.Parameter(torch.randn(config.num_experts, config.hidden_size) * 0.01)
        self.seen_token_ids: list[torch.Tensor] = []

    @property
    def constraint(self) -> RoutingConstraint:
        return RoutingConstraint(RoutingKind.EXACT_K, 1, 1)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        self.seen_token_ids.append(token_ids_T.clone())
        routing_map_TE = F.one_hot(token_ids_T % self.num_experts, self.num_experts).bool()
        probs_TE = torch.sigmoid(hidden_TD @ self.weight.t()) * routing_map_TE
        aux = {"spy_l2": self.config.aux_coeff * self.weight.pow(2).sum()} if self.training else {}
        return RouterOutput(probs_TE, routing_map_TE, aux, routing_metrics(probs_TE, routing_map_TE))


@pytest.fixture(scope="module")
def spy_router():
    routers.register_router(SPY)(SpyRouter)
    yield SPY
    # Registered only for this module's tests: other suites list the registry (private dict, test-only).
    from routers import registry

    registry._REGISTRY.pop(SPY, None)


# --------------------------------------------------------------------------------- flavours
def test_flavour_table_and_lookup():
    assert {"tiny", "tiny-dense", "185m", "185m-dense"} <= set(available_flavours())
    t = get_flavour("tiny")
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.num_query_groups) == (2, 128, 4, 2)
    assert (t.ffn_hidden_size, t.num_experts, t.top_k, t.seq_length, t.vocab_size) == (256, 8, 1, 128, None)
    m = get_flavour("185m")
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels) == (12, 768, 12, 4, 64)
    assert (m.ffn_hidden_size, m.num_experts, m.top_k, m.seq_length) == (3072, 8, 1, 1024)
    assert (m.rotary_base, m.init_method_std, m.padded_vocab_size()) == (1_000_000, 0.01, 50304)
    d = get_flavour("185m-dense")
    assert not d.is_moe and d.ffn_hidden_size == 3072 and d.num_layers == 12
    assert not get_flavour("tiny-dense").is_moe
    with pytest.raises(ValueError, match="available: .*185m"):
        get_flavour("llama-7b")
    # A flavour's experiments carry its name (dirmoe-185m); a run written under the earlier name still loads.
    assert get_flavour("llama-185m") == m and get_flavour("llama-185m-dense") == d
    over = get_flavour("tiny", num_experts=16, top_k=2, seq_length=64, vocab_size=300)
    assert (over.num_experts, over.top_k, over.seq_length, over.padded_vocab_size()) == (16, 2, 64, 384)
    assert dataclasses.replace(t, top_k=2).top_k == 2
    with pytest.raises(ValueError, match="valid: "):
        get_flavour("tiny", experts=4)
    with pytest.raises(ValueError, match="top_k"):
        get_flavour("tiny", top_k=9)


def test_llama_185m_transformer_config():
    cfg = transformer_config("185m", "switch", bf16=False, backend="local")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (12, 768, 12, 4)
    assert (cfg.ffn_hidden_size, cfg.moe_ffn_hidden_size, cfg.num_moe_experts, cfg.moe_router_topk) == (3072, 3072, 8, 1)
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and cfg.activation_func is F.silu
    assert not cfg.add_bias_linear and not cfg.add_qkv_bias
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0 and cfg.init_method_std == 0.01
    assert cfg.moe_router_dtype == "fp32" and cfg.moe_aux_loss_coeff == 0.0  # our routers bring their own
    mega = transformer_config("185m", MEGATRON_ROUTER, {"aux_loss_coeff": 1e-3})
    assert mega.moe_router_load_balancing_type == "aux_loss" and mega.moe_aux_loss_coeff == 1e-3
    with pytest.raises(ValueError, match="valid: aux_loss_coeff"):
        transformer_config("185m", MEGATRON_ROUTER, {"alpha": 1})


def test_tiny_parameter_count_matches_the_architecture():
    V, h, L, a, g, f, E = 128, 128, 2, 4, 2, 256, 8  # vocabulary 100 padded to 128
    d_head = h // a
    attention = h * (a * d_head + 2 * g * d_head) + a * d_head * h  # GQA qkv + output projection
    swiglu = h * 2 * f + f * h
    per_layer = attention + 2 * h + E * h + E * swiglu  # two RMSNorms, router [E, h], E experts
    expected = 2 * V * h + L * per_layer + h  # untied embedding and output layer, final RMSNorm
    model = tiny("switch")
    assert sum(p.numel() for p in model.parameters()) == expected
    dense = tiny(flavour="tiny-dense")
    assert sum(p.numel() for p in dense.parameters()) == 2 * V * h + L * (attention + 2 * h + swiglu) + h
    assert model.config.num_moe_experts == E and model.flavour.vocab_size == VOCAB


def test_same_seed_same_initial_weights():
    a, b, c = tiny("switch", seed=3), tiny("switch", seed=3), tiny("switch", seed=4)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        if isinstance(pa, torch.Tensor):  # megatron's `_extra_state` entries are None
            assert torch.equal(pa, pb), name
    assert not torch.equal(a.decoder.layers[0].mlp.router.router.weight, c.decoder.layers[0].mlp.router.router.weight)


def test_builder_argument_errors():
    with pytest.raises(ValueError, match="needs a router"):
        tiny(None)
    with pytest.raises(ValueError, match="dense"):
        tiny("switch", flavour="tiny-dense")
    with pytest.raises(ValueError, match="unknown router 'nope'; valid: megatron, .*switch"):
        tiny("nope")
    with pytest.raises(ValueError, match="pass vocab_size"):
        build_model("tiny", "switch")


# ------------------------------------------------------------------------- forward / backward
def _assert_finite_grads(model):
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient for {missing[:5]}"
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), n


def test_dense_forward_backward_finite():
    model = tiny(flavour="tiny-dense")
    loss = lm_loss(model)
    assert torch.isfinite(loss) and abs(float(loss) - torch.log(torch.tensor(128.0))) < 0.5
    loss.backward()
    _assert_finite_grads(model)


@pytest.mark.parametrize("backend", ["torch", "local"])
def test_a_bf16_model_has_bf16_norms_and_float32_routers(backend):
    """As Megatron-LM's Float16Module: every parameter bf16 but the routers' (float32, DirMoE's heads too). Norm
    weights left float32 send bf16 activations down torch.rms_norm's
    composite path (its "Mismatch dtype" warning; on CUDA, no fused kernel)."""
    import warnings

    model = build_model("tiny", "dirmoe", vocab_size=VOCAB, seq_length=SEQ, bf16=True, backend=backend, seed=1)
    in_routers = {id(p) for r in routers_in(model) for p in r.parameters()}
    dtypes = {name: p.dtype for name, p in model.named_parameters() if id(p) not in in_routers}
    assert any("layernorm" in name for name in dtypes) and set(dtypes.values()) == {torch.bfloat16}, dtypes
    assert in_routers and all(p.dtype == torch.float32 for r in routers_in(model) for p in r.parameters())
    ids_BS = torch.randint(0, VOCAB, (BATCH, SEQ))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Mismatch dtype")
        with token_ids_context(model, ids_BS):
            loss = model(ids_BS, torch.arange(SEQ)[None].expand(BATCH, SEQ), causal_attention_mask(SEQ), labels=ids_BS)
        loss.float().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", [MEGATRON_ROUTER, *routers.available_routers()])
def test_every_router_in_the_model_forward_backward(name):
    model = tiny(name)
    loss = lm_loss(model)
    assert torch.isfinite(loss)
    loss.backward()
    _assert_finite_grads(model)
    layers = model.decoder.layers
    if name == MEGATRON_ROUTER:
        from megatron.core.transformer.moe.router import TopKRouter

        assert all(isinstance(layer.mlp.router, TopKRouter) for layer in layers)
        return
    for layer in layers:
        adapter = layer.mlp.router
        assert isinstance(adapter, MegatronRouterAdapter)
        assert isinstance(adapter.router, routers.router_class(name))
        assert isinstance(layer.mlp, LoryMoELayer) == (name == "lory")
    metrics = collect_routing_metrics(model)
    assert sorted(metrics) == [1, 2]
    assert metrics[1]["tokens_per_expert"].shape == (8,)
    assert all(a.token_ids is None for a in router_adapters(model))


def test_switch_in_the_model_matches_megatron_topk_router():
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    reference = tiny(MEGATRON_ROUTER, {"aux_loss_coeff": 1e-2})
    ours = tiny("switch", {"aux_loss_coeff": 1e-2})
    # Same weights: megatron's router.weight [E, h] is the switch gate's weight.
    state = {k.replace("mlp.router.weight", "mlp.router.router.weight"): v for k, v in reference.state_dict().items()}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("router.router.step") for k in missing), missing

    tracker = get_moe_layer_wise_logging_tracker()
    results = {}
    for tag, model in (("megatron", reference), ("switch", ours)):
        clear_aux_losses_tracker()
        loss = lm_loss(model)
        loss.backward()
        logged = tracker["load_balancing_loss"]["values"].clone()
        results[tag] = (loss.detach(), {n.replace("router.router", "router"): p.grad for n, p in model.named_parameters()}, logged)
    torch.testing.assert_close(results["switch"][0], results["megatron"][0], rtol=0, atol=0)
    for name, grad in results["megatron"][1].items():
        torch.testing.assert_close(results["switch"][1][name], grad, rtol=1e-5, atol=1e-8, msg=name)
    # megatron logs loss / coeff, the adapter the weighted loss.
    torch.testing.assert_close(results["switch"][2], 1e-2 * results["megatron"][2])
    reference.eval(), ours.eval()
    ids_BS, pos_BS, mask, _ = make_batch(1)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids_BS, pos_BS, mask), reference(ids_BS, pos_BS, mask), rtol=0, atol=0)


def test_aux_loss_gradient_flows_through_probs_and_is_logged(spy_router):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    grads = {}
    for coeff in (0.0, 0.5):
        model = tiny(spy_router, {"aux_coeff": coeff})
        clear_aux_losses_tracker()
        lm_loss(model).backward()
        grads[coeff] = [(a.router.weight.detach().clone(), a.router.weight.grad.clone()) for a in router_adapters(model)]
        if coeff:
            logged = get_moe_layer_wise_logging_tracker()["spy_l2"]["values"]
            expected = torch.stack([coeff * w.pow(2).sum() for w, _ in grads[coeff]])
            torch.testing.assert_close(logged, expected)
            aux = collect_aux_losses(model)
            torch.testing.assert_close(aux[2]["spy_l2"], expected[1])
    for (w, g_aux), (_, g_plain) in zip(grads[0.5], grads[0.0]):
        # d(0.5 |W|^2)/dW = W, injected by MoEAuxLossAutoScaler with the default scale 1.
        torch.testing.assert_close(g_aux - g_plain, w, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("training", [False, True])
def test_dirmoe_dense_dispatch_in_megatrons_moe_layer_is_the_sum_over_experts(training):
    """dispatch="dense" through megatron-core's MoE layer and dispatcher is y = sum_i r_i E_i(x) exactly."""
    model = tiny("dirmoe", {"dispatch": "dense"}).train(training)
    layer = model.decoder.layers[0].mlp
    adapter = layer.router
    S, B, H = 6, 2, 128
    hidden_SBH = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7))
    hidden_TH = hidden_SBH.reshape(S * B, H)
    with torch.no_grad():
        torch.manual_seed(3)
        out_SBH, bias = layer(hidden_SBH)
        torch.manual_seed(3)  # the same logistic noise and Dirichlet draw in training mode
        r_TE = adapter.router(hidden_TH).probs
        experts = layer.experts.local_experts
        expected_TH = sum(r_TE[:, i : i + 1] * experts[i](hidden_TH)[0] for i in range(len(experts)))
    assert bias is None and r_TE.shape == (S * B, 8) and (r_TE > 0).all()
    torch.testing.assert_close(r_TE.sum(-1), torch.ones(S * B))
    torch.testing.assert_close(out_SBH.reshape(S * B, H), expected_TH, rtol=1e-5, atol=1e-6)
    # Threshold dispatch on the same weights is not the dense mixture.
    sparse = tiny("dirmoe").eval()
    sparse.load_state_dict(model.state_dict())
    with torch.no_grad():
        sparse_SBH, _ = sparse.decoder.layers[0].mlp(hidden_SBH)
    assert (sparse_SBH - out_SBH).norm() > 0.1 * out_SBH.norm()


def test_dirmoe_reports_per_expert_and_collapse_metrics_per_layer():
    model = tiny("dirmoe", {"balance_loss_coeff": 1e-2})
    lm_loss(model).backward()
    metrics = collect_routing_metrics(model)
    assert sorted(metrics) == [1, 2]
    for layer, values in metrics.items():
        for name in ("tokens_per_expert", "load_share", "weight_share"):
            assert values[name].shape == (8,), (layer, name)
        torch.testing.assert_close(values["load_share"].sum(), torch.tensor(1.0))
        for name in ("fallback_share", "input_mean_energy", "decoder_mean_alignment", "simpson_theta_target",
                     "load_imbalance", "active_experts", "simpson_r", "simpson_theta"):
            assert values[name].numel() == 1 and torch.isfinite(values[name]), (layer, name)
        assert 0.0 <= float(values["input_mean_energy"]) <= 1.0
    assert "load_balancing_loss" in collect_aux_losses(model)[1]


# ------------------------------------------------------------------------------ token ids
def test_token_ids_reach_the_router_in_megatron_order(spy_router):
    model = tiny(spy_router)
    ids_BS, pos_BS, mask, _ = make_batch(3)
    with token_ids_context(model, ids_BS) as ids_T:
        model(ids_BS, pos_BS, mask)
        assert all(a.token_ids is ids_T for a in router_adapters(model))
    expected_T = ids_BS.t().reshape(-1)  # t = s * B + b
    for adapter in router_adapters(model):
        assert len(adapter.router.seen_token_ids) == 1
        assert torch.equal(adapter.router.seen_token_ids[0], expected_T)
        assert adapter.token_ids is None, "ids must not outlive the forward"


def test_hash_in_the_model_routes_by_token_id():
    model = tiny("hash", {"hash_type": "mod"})
    ids_BS, pos_BS, mask, _ = make_batch(4)
    with token_ids_context(model, ids_BS):
        model(ids_BS, pos_BS, mask)
    counts_E = torch.bincount(ids_BS.reshape(-1) % 8, minlength=8).float()
    for layer, metrics in collect_routing_metrics(model).items():
        torch.testing.assert_close(metrics["tokens_per_expert"], counts_E, msg=f"layer {layer}")
    assert router_adapters(model)[0].router.config.vocab_size == 128, "hash table covers the padded vocabulary"


def test_token_ids_do_not_leak_between_models_or_outlive_the_context():
    a, b = tiny("hash"), tiny("hash")
    ids_BS, pos_BS, mask, _ = make_batch(5)
    with token_ids_context(a, ids_BS):
        with pytest.raises(RuntimeError, match="needs token ids.*token_ids_context"):
            b(ids_BS, pos_BS, mask)
        with pytest.raises(RuntimeError, match="nested"):
            with token_ids_context(a, ids_BS):
                pass
        a(ids_BS, pos_BS, mask)
    with pytest.raises(RuntimeError, match="needs token ids"):
        a(ids_BS, pos_BS, mask)
    with pytest.raises(ZeroDivisionError):  # cleared even when the block raises
        with token_ids_context(a, ids_BS):
            raise ZeroDivisionError
    assert all(ad.token_ids is None for ad in router_adapters(a) + router_adapters(b))


def test_routing_metrics_are_per_model_and_reset():
    a, b = tiny("switch"), tiny("switch")
    lm_loss(a, seed=0)
    lm_loss(a, seed=1)
    first = router_adapters(a)[0].last_metrics["tokens_per_expert"]
    assert collect_routing_metrics(b) == {}
    mean = collect_routing_metrics(a)[1]["tokens_per_expert"]
    assert float(mean.sum()) == SEQ * BATCH and router_adapters(a)[0].stats.count == 2
    assert float(first.sum()) == SEQ * BATCH
    reset_routing_stats(a)
    assert collect_routing_metrics(a) == {}
    lm_loss(a)
    reset_routing_stats(a)
    assert collect_aux_losses(a) == {}


def test_sparsemixer_routers_of_a_model_pool_their_balance_loss():
    model = tiny("sparsemixer").train()
    adapters = router_adapters(model)
    pools = {id(a.router._pool) for a in adapters}
    assert len(adapters) == 2 and len(pools) == 1 and adapters[0].router._pool.num_layers == 2
    lm_loss(model).backward()
    # GRIN's one loss over both layers' logits, carried by the forward's last layer.
    assert [sorted(a.last_aux_losses) for a in adapters] == [[], ["load_balancing_loss"]]
    assert all(a.router.weight.grad is not None for a in adapters)


# ------------------------------------------------------------------------------------ Lory
def _expert_weights(layer: LoryMoELayer):
    fc1_EGH, fc2_EHF = layer.expert_weights()
    return fc1_EGH.detach(), fc2_EHF.detach()


def test_lory_merge_identities():
    model = tiny("lory")
    layer = model.decoder.layers[0].mlp
    experts = layer.experts.local_experts
    fc1_EGH, fc2_EHF = _expert_weights(layer)
    x_BLH = torch.randn(2, 5, 128)
    w_BE = torch.softmax(torch.randn(2, 8), -1)
    merged_BLH = lory_merged_ffn(x_BLH, w_BE, fc1_EGH, fc2_EHF)
    for b in range(2):
        # 1. The merged FFN is megatron's expert MLP with the weighted-sum parameters.
        merged_params = {
            "linear_fc1.weight": torch.einsum("e,egh->gh", w_BE[b], fc1_EGH),
            "linear_fc2.weight": torch.einsum("e,ehf->hf", w_BE[b], fc2_EHF),
        }
        with torch.no_grad():
            out, _ = functional_call(experts[0], merged_params, (x_BLH[b],))
        torch.testing.assert_close(merged_BLH[b], out, rtol=1e-5, atol=1e-6)
        # 2. Its first projection is linear in the parameters: merged pre-activations = mixed pre-activations.
        with torch.no_grad():
            mixed_pre = sum(w_BE[b, e] * experts[e].linear_fc1(x_BLH[b])[0] for e in range(8))
            merged_pre = x_BLH[b] @ merged_params["linear_fc1.weight"].t()
            torch.testing.assert_close(merged_pre, mixed_pre, rtol=1e-5, atol=1e-6)
            # 3. But the merged FFN is not the mixture of the experts' outputs (SwiGLU is nonlinear).
            mixed_out = sum(w_BE[b, e] * experts[e](x_BLH[b])[0] for e in range(8))
        assert (merged_BLH[b] - mixed_out).norm() > 0.1 * mixed_out.norm()
    # 4. A one-hot segment weight runs exactly that expert.
    for e in (0, 5):
        one_hot_BE = F.one_hot(torch.tensor([e, e]), 8).float()
        with torch.no_grad():
            expert_out = torch.stack([experts[e](x_BLH[b])[0] for b in range(2)])
        torch.testing.assert_close(lory_merged_ffn(x_BLH, one_hot_BE, fc1_EGH, fc2_EHF), expert_out, rtol=1e-5, atol=1e-6)


def test_lory_layer_merges_per_segment_with_the_routers_weights():
    model = tiny("lory", {"segment_len": 4})
    layer = model.decoder.layers[0].mlp
    assert layer.segment_length == 4
    S, B, H = 10, 2, 128  # segments of 4, 4 and 2 tokens
    hidden_SBH = torch.randn(S, B, H, requires_grad=True)
    out_SBH, bias = layer(hidden_SBH)
    assert bias is None and out_SBH.shape == (S, B, H)
    weights_BGE = layer.router.router.segment_weights(hidden_SBH.detach().reshape(S * B, H), (S, B))
    fc1_EGH, fc2_EHF = _expert_weights(layer)
    for g, start in enumerate(range(0, S, 4)):
        ref_BlH = lory_merged_ffn(hidden_SBH.detach()[start : start + 4].transpose(0, 1), weights_BGE[:, g], fc1_EGH, fc2_EHF)
        torch.testing.assert_close(out_SBH.detach()[start : start + 4].transpose(0, 1), ref_BlH, rtol=1e-5, atol=1e-6)
    out_SBH.sum().backward()
    assert layer.router.router.weight.grad.abs().sum() > 0, "the router learns through the merged parameters"
    # Causal: the first segment's output does not depend on later tokens.
    hidden2 = hidden_SBH.detach().clone()
    hidden2[4:] = torch.randn(S - 4, B, H)
    torch.testing.assert_close(layer(hidden2)[0].detach()[:4], out_SBH.detach()[:4])


def test_lory_dense_start_trains_one_ffn_held_as_tied_experts():
    # schedule_steps=100 at the default 5%: steps 0-4 are dense.
    model = tiny("lory", {"segment_len": 4, "schedule_steps": 100})
    layer = model.decoder.layers[0].mlp
    router = layer.router.router
    assert router.config.dense_steps == 5 and router.dense_phase
    fc1_EGH, fc2_EHF = _expert_weights(layer)
    assert all(torch.equal(fc1_EGH[e], fc1_EGH[0]) and torch.equal(fc2_EHF[e], fc2_EHF[0]) for e in range(8))
    router.set_step(4)
    assert router.dense_phase and not router.weight.requires_grad
    S, B, H = 10, 2, 128
    hidden_SBH = torch.randn(S, B, H)
    out_SBH, _ = layer(hidden_SBH)
    # The dense phase runs expert 0 (any expert: they are equal) on every token, to the bit.
    with torch.no_grad():
        expert_SBH = layer.experts.local_experts[0](hidden_SBH.reshape(S * B, H))[0].reshape(S, B, H)
    torch.testing.assert_close(out_SBH.detach(), expert_SBH, rtol=1e-6, atol=1e-7)
    out_SBH.square().sum().backward()
    # Every expert gets the dense FFN's gradient / sqrt(8): the same for all, and the router none.
    grads = [e.linear_fc1.weight.grad for e in layer.experts.local_experts]
    assert grads[0].abs().sum() > 0 and all(torch.equal(g, grads[0]) for g in grads)
    dense = layer.experts.local_experts[0]
    w1 = dense.linear_fc1.weight.detach().clone().requires_grad_(True)
    w2 = dense.linear_fc2.weight.detach().clone().requires_grad_(True)
    ref = lory_merged_ffn(hidden_SBH.reshape(1, S * B, H), torch.ones(1, 1), w1[None], w2[None])
    ref.square().sum().backward()
    torch.testing.assert_close(grads[0], w1.grad / 8**0.5, rtol=1e-5, atol=1e-8)
    assert router.weight.grad is None
    # From the switch on, the router routes and learns; the phase follows the step buffer on load.
    router.set_step(5)
    assert not router.dense_phase and router.weight.requires_grad
    layer(hidden_SBH)[0].sum().backward()
    assert router.weight.grad is not None
    state = router.state_dict()
    fresh = tiny("lory", {"segment_len": 4, "schedule_steps": 100}).decoder.layers[0].mlp.router.router
    assert fresh.dense_phase
    fresh.load_state_dict(state)
    assert not fresh.dense_phase
    # No schedule (a router built outside a run) or dense_fraction=0: no dense phase, experts drawn apart.
    for options in ({}, {"schedule_steps": 100, "dense_fraction": 0.0}):
        other = tiny("lory", options).decoder.layers[0].mlp
        assert not other.router.router.dense_phase
        fc1_EGH, _ = _expert_weights(other)
        assert not torch.equal(fc1_EGH[1], fc1_EGH[0])


def test_lory_prompt_routing_routes_once_on_the_prompt():
    model = tiny("lory", {"segment_len": 4}).eval()
    layer = model.decoder.layers[0].mlp
    S, B, H = 10, 2, 128
    hidden_SBH = torch.randn(S, B, H)
    prompt_B = torch.tensor([3, 6])
    with torch.no_grad(), prompt_routing(model, prompt_B):
        out_SBH, _ = layer(hidden_SBH)
        changed = hidden_SBH.clone()
        changed[6:] = torch.randn(S - 6, B, H)  # the continuation must not change the routing
        out_changed_SBH, _ = layer(changed)
    assert all(lay.mlp._prompt_lengths_B is None for lay in model.decoder.layers), "cleared on exit"
    fc1_EGH, fc2_EHF = _expert_weights(layer)
    gate_ED = layer.router.router.weight.detach()
    for b in range(B):
        w_E = torch.softmax(hidden_SBH[: prompt_B[b], b].mean(0) @ gate_ED.t(), -1)
        ref_SH = lory_merged_ffn(hidden_SBH[:, b][None], w_E[None], fc1_EGH, fc2_EHF)[0]
        torch.testing.assert_close(out_SBH[:, b], ref_SH, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_changed_SBH[:6], out_SBH[:6])
    # The whole model runs under the context too.
    ids_BS, pos_BS, mask, _ = make_batch(2)
    with torch.no_grad(), token_ids_context(model, ids_BS), prompt_routing(model, [4, 9]):
        assert torch.isfinite(model(ids_BS, pos_BS, mask)).all()


# ------------------------------------------------------------------ expert parallel (torchrun)
# One torchrun for the model's expert parallelism and the torch backend's (tests/test_backends.py): starting the
# two ranks costs more than all the checks.
_EP2_WORKER = r"""
import sys, warnings
warnings.filterwarnings("ignore")
import torch
from repro.model.builder import build_model, causal_attention_mask
from repro.model.parallel import destroy_distributed, init_distributed
from routers.megatron_adapter import collect_routing_metrics, token_ids_context

info = init_distributed(tp=1, ep=2, seed=1)
assert info.world_size == 2 and info.backend == "gloo"
S, B = 16, 2
g = torch.Generator().manual_seed(100 + info.rank)  # different data per rank: uneven all-to-all splits
ids = torch.randint(0, 100, (B, S), generator=g)
pos, mask = torch.arange(S)[None].expand(B, S), causal_attention_mask(S)
for name in ("switch", "remoe", "hash", "megatron"):
    model = build_model("tiny", name, vocab_size=100, seq_length=S, seed=0)
    assert len(model.decoder.layers[0].mlp.experts.local_experts) == 4
    with token_ids_context(model, ids):
        loss = model(ids, pos, mask, labels=ids).mean()
    loss.backward()
    assert torch.isfinite(loss), name
    assert all(torch.isfinite(p.grad).all() for p in model.parameters()), name
    if name != "megatron":
        assert sorted(collect_routing_metrics(model)) == [1, 2], name
try:
    build_model("tiny", "lory", vocab_size=100, seq_length=S)
    raise SystemExit("lory must refuse expert parallelism")
except ValueError as exc:
    assert "expert parallel" in str(exc)

# The torch backend (grouped GEMMs) against the local one through the all-to-all: two SGD steps.
for name in ("switch", "remoe"):
    traces = {}
    for backend in ("local", "torch"):
        model = build_model("tiny", name, vocab_size=100, seq_length=S, seed=0, backend=backend)
        experts = model.decoder.layers[0].mlp.experts
        assert (experts.num_local_experts, type(experts).__name__) == (4, {"local": "SequentialMLP", "torch": "TorchGroupedMLP"}[backend])
        if backend == "torch":
            assert experts.fc1_weight.allreduce is False  # expert gradients stay out of the DP all-reduce
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        trace = []
        for step in range(2):
            g = torch.Generator().manual_seed(100 * step + info.rank)  # different data per rank: uneven splits
            ids = torch.randint(0, 100, (B, S), generator=g)
            opt.zero_grad()
            with token_ids_context(model, ids):
                loss = model(ids, pos, mask, labels=ids).mean()
            loss.backward()
            opt.step()
            trace.append(float(loss))
        traces[backend] = (trace, {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)})
    (lt, ls), (tt, ts) = traces["local"], traces["torch"]
    assert list(ls) == list(ts), name
    torch.testing.assert_close(torch.tensor(tt), torch.tensor(lt), rtol=1e-5, atol=0)
    for key in ls:  # after two SGD steps through the all-to-all, every weight agrees
        torch.testing.assert_close(ts[key], ls[key], rtol=1e-4, atol=1e-6, msg=f"{name} {key}")
destroy_distributed()
print(f"EP2-OK rank {info.rank}")
"""


@pytest.mark.distributed
def test_expert_parallel_2_under_torchrun_alltoall(tmp_path):
    """EP=2 on two gloo ranks: every router's model with 4 of the 8 experts per rank trains a step through the
    all-to-all, Lory refuses, and the torch backend matches the local one over two SGD steps."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = tmp_path / "ep2_worker.py"
    worker.write_text(_EP2_WORKER)
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)],
        capture_output=True, text=True, env=env, cwd=repo, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.count("EP2-OK") == 2, out[-4000:]
