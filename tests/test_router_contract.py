"""The contract every registered router must honour. A new router gets these tests for free."""

from __future__ import annotations

import pytest
import torch

import routers
from routers import RouterOutput, RoutingKind

HIDDEN, EXPERTS, TOP_K = 32, 8, 1
SEQ, BATCH = 16, 4  # T = 64 tokens in megatron-core's [s, b] order
VOCAB = 100
COMMON_METRICS = {"active_experts", "simpson", "tokens_per_expert", "load_imbalance", "unrouted_tokens"}


def make_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden_TD = torch.randn(SEQ * BATCH, HIDDEN, generator=g)
    token_ids_T = torch.randint(0, VOCAB, (SEQ * BATCH,), generator=g)
    return hidden_TD, token_ids_T, (SEQ, BATCH)


def build(name: str, seed: int = 0) -> routers.Router:
    torch.manual_seed(seed)
    return routers.build_router(name, hidden_size=HIDDEN, num_experts=EXPERTS, top_k=TOP_K)


def run(router: routers.Router, seed: int = 0, inputs_seed: int = 0) -> RouterOutput:
    hidden_TD, token_ids_T, seq_shape = make_inputs(inputs_seed)
    torch.manual_seed(seed)
    return router(hidden_TD, token_ids_T, seq_shape)


def _installed_routers() -> list[str]:
    """Every router a package registers (the built-in ones and other packages' entry points): the registry's
    names minus routers defined inside test modules, so what the suite covers never depends on which test
    modules were collected first. Tests that define a router run these checks on it themselves."""
    return [n for n in routers.available_routers() if not routers.router_class(n).__module__.startswith("test_")]


ALL = _installed_routers()


def test_registry_has_the_eight_routers():
    assert {"dirmoe", "switch", "remoe", "expert_choice", "hash", "lory", "sparsemixer", "auxfree"} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_declarations_agree_with_the_constraint(name):
    router = build(name)
    assert router.merges_experts == (router.constraint.kind is RoutingKind.MERGE)
    assert (type(router).moe_layer_class() is not None) <= router.merges_experts  # own layers only for merging
    for scale, items in type(router).recipe_overrides.items():
        assert scale in ("tiny", "185m") and all("=" in item for item in items), (scale, items)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("training", [True, False])
def test_output_shapes_dtypes_and_constraint(name, training):
    router = build(name).train(training)
    out = run(router)
    T = SEQ * BATCH
    assert out.probs.shape == (T, EXPERTS) and out.probs.dtype == torch.float32
    assert out.routing_map.shape == (T, EXPERTS) and out.routing_map.dtype == torch.bool
    assert torch.isfinite(out.probs).all()
    assert (out.probs >= 0).all()
    assert (out.probs[~out.routing_map] == 0).all(), "probs must be zero off the routing map"
    constraint = router.constraint
    constraint.check(out.routing_map)
    if constraint.probs_sum_to_one:
        routed_T = out.routing_map.any(-1)
        torch.testing.assert_close(out.probs[routed_T].sum(-1), torch.ones(int(routed_T.sum())))


@pytest.mark.parametrize("name", ALL)
def test_aux_losses_and_metrics(name):
    router = build(name).train()
    out = run(router)
    for key, loss in out.aux_losses.items():
        assert loss.dim() == 0, key
        assert torch.isfinite(loss), key
        assert loss.requires_grad, f"aux loss {key} is not attached to the graph"
    assert COMMON_METRICS <= set(out.metrics), f"missing metrics: {COMMON_METRICS - set(out.metrics)}"
    for key, value in out.metrics.items():
        assert not value.requires_grad, f"metric {key} is not detached"
        assert torch.isfinite(value.float()).all(), key
    assert out.metrics["tokens_per_expert"].shape == (EXPERTS,)


@pytest.mark.parametrize("name", ALL)
def test_gradients_reach_every_trainable_parameter(name):
    router = build(name).train()
    if name == "lory":
        # Lory's router learns only from the second segment on (the paper's stop-gradient on the first),
        # so give it segments shorter than the sequence (its default 256 would make SEQ one segment).
        torch.manual_seed(0)
        router = routers.build_router(name, hidden_size=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, segment_len=4).train()
    hidden_TD, token_ids_T, seq_shape = make_inputs()
    hidden_TD.requires_grad_(True)
    torch.manual_seed(0)
    out = router(hidden_TD, token_ids_T, seq_shape)
    # A random per-expert downstream signal stands in for the experts' outputs.
    signal_TE = torch.randn_like(out.probs)
    loss = (out.probs * signal_TE).sum() + out.total_aux_loss()
    params = [(n, p) for n, p in router.named_parameters() if p.requires_grad]
    if not params and not loss.requires_grad:
        assert router.constraint.kind in (RoutingKind.EXACT_K,), "a router without parameters must be fixed"
        return
    loss.backward()
    for pname, p in params:
        assert p.grad is not None, f"no gradient reaches {pname}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient in {pname}"
        assert p.grad.abs().sum() > 0, f"zero gradient in {pname}"


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_output(name):
    a = run(build(name, seed=3).train(), seed=7)
    b = run(build(name, seed=3).train(), seed=7)
    torch.testing.assert_close(a.probs, b.probs, rtol=0, atol=0)
    assert torch.equal(a.routing_map, b.routing_map)


@pytest.mark.parametrize("name", ALL)
def test_eval_mode_is_deterministic(name):
    router = build(name).eval()
    with torch.no_grad():
        a = run(router, seed=1)
        b = run(router, seed=2)  # a different RNG state must not change eval routing
    torch.testing.assert_close(a.probs, b.probs, rtol=0, atol=0)
    assert torch.equal(a.routing_map, b.routing_map)


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip_restores_schedules(name):
    src = build(name, seed=1).train()
    for step in range(3):
        routers.begin_step(src, step)
        run(src, seed=step)
        routers.end_step(src)
    dst = build(name, seed=2)
    dst.load_state_dict(src.state_dict())
    assert int(dst.step) == int(src.step) == 2
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), k
    src.eval(), dst.eval()
    with torch.no_grad():
        torch.testing.assert_close(run(src).probs, run(dst).probs, rtol=0, atol=0)


def test_unknown_router_and_option_errors_list_what_is_valid():
    with pytest.raises(ValueError, match="available: .*dirmoe"):
        routers.build_router("nope", hidden_size=8, num_experts=4)
    with pytest.raises(ValueError, match="valid: "):
        routers.build_router("switch", hidden_size=8, num_experts=4, not_an_option=1)
    with pytest.raises(ValueError, match="top_k"):
        routers.build_router("switch", hidden_size=8, num_experts=4, top_k=5)
