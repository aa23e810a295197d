"""The aux-loss-free router against megatron-core 0.16.1's own TopKRouter in its expert-bias mode, and its bias
in checkpoints. The shared contract is in tests/test_router_contract.py."""

from __future__ import annotations

import pytest
import torch
from test_baselines import megatron_cpu, megatron_parallel, megatron_router_config  # noqa: F401 - fixtures

import routers
from baselines.auxfree import AuxFreeConfig

D, E = 32, 8
S, B = 16, 4
T = S * B


def megatron_config(cfg: AuxFreeConfig):
    return megatron_router_config(
        cfg,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=cfg.bias_update_rate,
        moe_router_topk_scaling_factor=cfg.topk_scaling_factor,
        moe_router_load_balancing_type="seq_aux_loss" if cfg.seq_aux_loss_coeff else "none",
        moe_aux_loss_coeff=cfg.seq_aux_loss_coeff,
    )


@pytest.mark.parametrize(
    "options",
    [
        {"top_k": 1},
        {"top_k": 2},
        {"top_k": 4, "topk_scaling_factor": 2.5, "bias_update_rate": 1e-2},
        {"top_k": 2, "seq_aux_loss_coeff": 1e-4},
    ],
    ids=["top1", "top2", "top4-scaled", "top2-seqaux"],
)
def test_auxfree_agrees_with_megatron_topk_router_over_steps(megatron_parallel, megatron_cpu, options):  # noqa: F811
    """Same weights, same micro-batches, same SGD steps: the same choices, weights, gate gradients and bias
    after each step, the bias updated by megatron's own ``_update_router_expert_bias``."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    tracker = megatron_cpu
    torch.manual_seed(0)
    ours = routers.build_router("auxfree", hidden_size=D, num_experts=E, **options).train()
    cfg = ours.config
    mcfg = megatron_config(cfg)
    theirs = TopKRouter(mcfg, pg_collection=get_default_pg_collection()).train()
    theirs.set_layer_number(1)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
    g = torch.Generator().manual_seed(1)
    # A strong constant pull toward a few experts, so the counts are unbalanced and the bias moves both ways.
    skew_D = torch.randn(D, generator=g) * 3
    lr = 0.5
    for step in range(6):
        routers.begin_step(ours, step)
        seq_aux = torch.zeros(())
        for _ in range(2):  # two micro-batches per step: the update uses their summed counts
            hidden_SBD = torch.randn(S, B, D, generator=g) + skew_D
            signal_TE = torch.randn(T, E, generator=g)
            probs_m, map_m = theirs(hidden_SBD)
            (probs_m * signal_TE).sum().backward()  # megatron injects its seq aux-loss gradient here
            out = ours(hidden_SBD.reshape(T, D), None, (S, B))
            ((out.probs * signal_TE).sum() + out.total_aux_loss()).backward()
            assert torch.equal(out.routing_map, map_m), step
            torch.testing.assert_close(out.probs, probs_m.float(), rtol=1e-6, atol=1e-7)
            assert set(out.aux_losses) == ({"seq_load_balancing_loss"} if cfg.seq_aux_loss_coeff else set())
            seq_aux += out.total_aux_loss().detach()
        if cfg.seq_aux_loss_coeff:  # megatron's tracker sums the step's micro-batches, divided by the coefficient
            logged = tracker["seq_load_balancing_loss"]["values"][0] * cfg.seq_aux_loss_coeff
            torch.testing.assert_close(seq_aux, logged, rtol=1e-5, atol=0)
            tracker.clear()
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(ours.tokens_per_expert, theirs.local_tokens_per_expert, rtol=0, atol=0)
        with torch.no_grad():  # one SGD step on both gates
            for p in (ours.weight, theirs.weight):
                p -= lr * p.grad
                p.grad = None
        _update_router_expert_bias([theirs], mcfg)
        theirs.local_tokens_per_expert.zero_()  # megatron's reset_model_temporary_tensors
        routers.end_step(ours)
        assert torch.equal(ours.expert_bias, theirs.expert_bias), step
        assert not ours.tokens_per_expert.any()
    assert ours.expert_bias.abs().max() > 0 and (ours.expert_bias > 0).any() and (ours.expert_bias < 0).any()


def test_bias_update_sums_counts_of_each_layer_and_eval_does_not_count():
    layers = torch.nn.ModuleList(
        [routers.build_router("auxfree", hidden_size=D, num_experts=4, bias_update_rate=0.1) for _ in range(2)]
    )
    layers[0].tokens_per_expert.copy_(torch.tensor([4.0, 0.0, 2.0, 2.0]))
    layers[1].tokens_per_expert.copy_(torch.tensor([1.0, 1.0, 1.0, 5.0]))
    routers.end_step(layers)
    torch.testing.assert_close(layers[0].expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    torch.testing.assert_close(layers[1].expert_bias, torch.tensor([0.1, 0.1, 0.1, -0.1]))
    layers.eval()
    with torch.no_grad():
        layers[0](torch.randn(T, D))
    layers.train()
    with torch.no_grad():
        layers[0](torch.randn(T, D))
    assert not layers[0].tokens_per_expert.any()  # neither evaluation nor no-grad forwards count


def test_metrics_only_when_collected_and_routing_unchanged():
    router = routers.build_router("auxfree", hidden_size=D, num_experts=E, top_k=2).train()
    router.expert_bias.copy_(torch.linspace(-0.2, 0.2, E))
    hidden_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(0))
    full = router(hidden_TD)
    router.collect_metrics = False
    lean = router(hidden_TD)
    assert lean.metrics == {} and {"expert_bias", "tokens_per_expert"} <= set(full.metrics)
    assert torch.equal(full.probs, lean.probs) and torch.equal(full.routing_map, lean.routing_map)
    assert torch.equal(router.tokens_per_expert, 2 * full.routing_map.sum(0).float())


def test_bias_stays_float32_under_bf16():
    router = routers.build_router("auxfree", hidden_size=D, num_experts=E).bfloat16().train()
    assert router.expert_bias.dtype == torch.float32 and router.weight.dtype == torch.bfloat16
    router(torch.randn(T, D).bfloat16())
    routers.end_step(router)
    assert router.expert_bias.dtype == torch.float32 and router.expert_bias.abs().max() == pytest.approx(1e-3)
