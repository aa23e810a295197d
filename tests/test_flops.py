"""Megatron-LM's model-FLOPs count (repro/records/flops.py): a hand count of every GEMM, the causal and the
full-square attention counts, and the DirMoE paper's TFLOP/s from its own iteration times."""

from __future__ import annotations

import dataclasses
import math

import pytest

from repro.records.flops import (
    FlopsConfig,
    analytic_flops_per_iteration,
    expert_flops_per_token,
    flops_config_from_flavour,
    model_flops_per_iteration,
    tflops_per_device,
)

#: LLaMA-185M of ReMoE and DirMoE (12 layers, hidden 768, GQA 12/4, SwiGLU 3072), E=8, k=1.
LLAMA_185M = FlopsConfig(
    num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=4, kv_channels=64,
    ffn_hidden_size=3072, vocab_size=50304, top_k=1, swiglu=True,
)
SMALL = FlopsConfig(
    num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=1, kv_channels=4,
    ffn_hidden_size=16, vocab_size=32, top_k=2, swiglu=True,
)


def _hand_count(cfg: FlopsConfig, B: int, s: int, k: float) -> float:
    """Every GEMM of one training iteration, 2*m*n*k FLOPs each, forward x 3 (forward + two backward); the
    attention scores over half the s x s square for the causal count, the whole square for the full one."""
    square = 0.5 if cfg.attention == "causal" else 1.0
    T, h, a, g, d, f = B * s, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.ffn_hidden_size
    gemm = lambda m, n, kk: 2 * m * n * kk  # noqa: E731
    per_layer = (
        gemm(T, a * d, h)  # query projection
        + 2 * gemm(T, g * d, h)  # key and value projections (GQA: g groups)
        + square * B * a * gemm(s, s, d)  # scores Q K^T
        + square * B * a * gemm(s, d, s)  # probabilities x V
        + gemm(T, h, a * d)  # output projection
        + k * (3 if cfg.swiglu else 2) * gemm(T, f, h)  # gate, up, down of the k experts
    )
    logits = gemm(T, cfg.vocab_size, h)
    return 3 * (cfg.num_layers * per_layer + logits)


@pytest.mark.parametrize("attention", ["causal", "full"])
@pytest.mark.parametrize("swiglu", [True, False])
def test_flops_formula_matches_a_hand_count(swiglu, attention):
    cfg = FlopsConfig(**{**SMALL.__dict__, "swiglu": swiglu, "attention": attention})
    assert math.isclose(analytic_flops_per_iteration(cfg, 3, 6), _hand_count(cfg, 3, 6, 2), rel_tol=1e-12)
    # measured: per-layer k values enter through their mean (the FFN term is linear in k)
    assert math.isclose(
        model_flops_per_iteration(cfg, 3, 6, [1.0, 2.5]), _hand_count(cfg, 3, 6, 1.75), rel_tol=1e-12
    )


def test_flops_llama_185m_and_published_device_count():
    flops = analytic_flops_per_iteration(LLAMA_185M, 512, 1024)
    assert LLAMA_185M.attention == "causal"
    assert flops == pytest.approx(4.78e14, rel=0.01)
    # DirMoE paper: 437.3 ms/iter and 137.2 TFLOP/s per GPU imply about 8 GPUs.
    assert flops / 0.4373 / 137.2e12 == pytest.approx(8, abs=0.5)
    dense = FlopsConfig(**{**LLAMA_185M.__dict__, "top_k": 1})
    assert model_flops_per_iteration(dense, 512, 1024, 1) == flops
    assert expert_flops_per_token(LLAMA_185M, 1) == 12 * 12 * 768 * 3072 * 1.5
    # The causal count differs from the full square by the halved scores term only: 12 B s^2 L a d / 2.
    full = analytic_flops_per_iteration(dataclasses.replace(LLAMA_185M, attention="full"), 512, 1024)
    assert full - flops == pytest.approx(12 * 512 * 1024**2 * 12 * 12 * 64 / 2, rel=1e-12)


#: The DirMoE paper's efficiency table: LLaMA-185M, E=8, k=1, 512 x 1024 tokens per iteration on 8 H100s.
PAPER_MS_TFLOPS = {"switch": (431.5, 138.2), "dirmoe": (437.3, 137.2)}


@pytest.mark.parametrize("router", sorted(PAPER_MS_TFLOPS))
def test_the_default_count_gives_the_papers_tflops_from_its_ms_per_iteration(router):
    ms, published = PAPER_MS_TFLOPS[router]
    flops = analytic_flops_per_iteration(LLAMA_185M, 512, 1024)
    assert tflops_per_device(flops, ms / 1e3, 8) == pytest.approx(published, rel=0.01)
    # The full square is the option, and it does not fit the paper (about 6% high).
    full = analytic_flops_per_iteration(dataclasses.replace(LLAMA_185M, attention="full"), 512, 1024)
    assert tflops_per_device(full, ms / 1e3, 8) > 1.04 * published


def test_the_flops_count_refuses_an_unknown_attention_count():
    with pytest.raises(ValueError, match="attention must be one of causal, full"):
        dataclasses.replace(LLAMA_185M, attention="half")


def test_flops_config_from_the_model_flavours():
    flavours = pytest.importorskip("repro.flavours")
    assert flops_config_from_flavour(flavours.get_flavour("185m"), vocab_size=50257) == LLAMA_185M
    dense = flops_config_from_flavour(flavours.get_flavour("185m").dense(), vocab_size=50257)
    assert dense.top_k == 1 and dense.ffn_hidden_size == 3072
    full = flops_config_from_flavour(flavours.get_flavour("185m"), vocab_size=50257, attention="full")
    assert full == dataclasses.replace(LLAMA_185M, attention="full")
