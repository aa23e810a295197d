"""megatron-core's compiled fusions in the torch backend (fused SwiGLU, native fused cross-entropy) against the
unfused maths, and on CPU the logic of tests/test_gpu.py (tests/gpu_harness.py): counting what a whole-model
step runs, and comparing bf16 gradients with fp32 ones, a wrong gradient included."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import routers
from repro.flavours import get_flavour
from repro.model.backends import TorchBackendOptions
from repro.model.builder import build_model, causal_attention_mask, transformer_config
from repro.model.parallel import destroy_distributed, init_distributed
from routers.megatron_adapter import token_ids_context

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

VOCAB, SEQ, BATCH = 100, 16, 2
E = 8
#: Tokens per expert: uneven, two experts empty (as the expert tests of tests/test_backends.py).
COUNTS = [5, 0, 3, 9, 1, 0, 4, 2]


@pytest.fixture(scope="module", autouse=True)
def distributed():
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    yield init_distributed(tp=1, ep=1, seed=1)
    get_moe_layer_wise_logging_tracker().clear()
    destroy_distributed()


def tiny(router_name="switch", backend="torch", seed=0, flavour="tiny"):
    return build_model(flavour, router_name, vocab_size=VOCAB, seq_length=SEQ, seed=seed, backend=backend)


def make_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids_BS, torch.arange(SEQ)[None].expand(BATCH, SEQ), causal_attention_mask(SEQ), labels_BS


def _experts(config, options):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from repro.model.torch_backend import TorchGroupedMLP

    return TorchGroupedMLP(E, config, pg_collection=get_default_pg_collection(), options=options)


def _run_experts(module, x_MH, counts, probs_M):
    x_MH = x_MH.detach().clone().requires_grad_()
    probs_M = probs_M.detach().clone().requires_grad_()
    out_MH, _ = module(x_MH, torch.tensor(counts), probs_M)
    g = torch.Generator().manual_seed(7)
    (out_MH * torch.randn(out_MH.shape, generator=g).to(out_MH.dtype)).sum().backward()
    return out_MH.detach(), x_MH.grad, probs_M.grad


# ----------------------------------------------------------------------------- megatron's compiled fusions
@contextlib.contextmanager
def _maybe_eager(compiled: bool):
    """megatron's fusions are torch.compile'd (megatron.core.jit); eager runs the same functions uncompiled
    (their custom forward/backward maths, in seconds), compiled goes through inductor's CPU code too."""
    if compiled:
        yield
    else:
        with torch._dynamo.config.patch(disable=True):
            yield


#: fp32: the fused backward's closed-form SiLU derivative against autograd's, a few ulps. bf16: both round
#: to bf16 at different points (the unfused path after each elementwise op), as the bf16 GEMM test allows.
FUSION_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_experts_match_the_unfused_activation(dtype, compiled, monkeypatch):
    """The torch backend's experts with megatron's fused weighted SwiGLU against the same experts unfused
    (whose equality with megatron's SequentialMLP tests/test_backends.py holds)."""
    from repro.model import torch_backend

    options = TorchBackendOptions(expert_gemm="grouped_mm")
    config = transformer_config(get_flavour("tiny"), "switch", bf16=dtype == torch.bfloat16, backend="local")
    assert not config.bias_activation_fusion
    torch.manual_seed(0)
    unfused = _experts(config, options)
    fused = _experts(dataclasses.replace(config, bias_activation_fusion=True), options)
    fused.load_state_dict(unfused.state_dict(), strict=True)
    calls = []
    real = torch_backend.weighted_bias_swiglu_impl
    monkeypatch.setattr(torch_backend, "weighted_bias_swiglu_impl", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(3)
    x_MH = torch.randn(sum(COUNTS), config.hidden_size, generator=g).to(dtype)
    probs_M = torch.rand(sum(COUNTS), generator=g)  # float32, as the routers give
    with _maybe_eager(compiled):
        out, dx, dp = _run_experts(fused, x_MH, COUNTS, probs_M)
    assert calls == [1]  # the fused function ran, once per forward
    expected = _run_experts(unfused, x_MH, COUNTS, probs_M)
    assert calls == [1]  # and the unfused experts did not take it
    assert (out.dtype, dx.dtype, dp.dtype) == (dtype, dtype, torch.float32)
    for actual, want in zip((out, dx, dp, fused.fc1_weight.grad, fused.fc2_weight.grad),
                            (*expected, unfused.fc1_weight.grad, unfused.fc2_weight.grad)):
        torch.testing.assert_close(actual, want, **FUSION_TOL[dtype])
    # the empty experts' gradients stay exactly zero through the fused path
    for e, c in enumerate(COUNTS):
        if c == 0:
            assert not fused.fc1_weight.grad[e].any() and not fused.fc2_weight.grad[e].any()


@pytest.mark.parametrize("flavour", ["tiny", "tiny-dense"])
def test_fused_swiglu_in_a_whole_model_matches_unfused(flavour, monkeypatch):
    """The torch backend's experts and megatron's dense MLP, both through the fused SwiGLU: loss and every
    gradient as unfused (fp32)."""
    from megatron.core.fusions import fused_bias_swiglu as fusion_module

    calls = {"SwiGLUFunction": 0, "WeightedSwiGLUFunction": 0}
    for name in calls:
        real = getattr(fusion_module, name).apply
        monkeypatch.setattr(getattr(fusion_module, name), "apply",
                            lambda *a, _n=name, _r=real: calls.__setitem__(_n, calls[_n] + 1) or _r(*a))
    ids_BS, pos_BS, mask, labels_BS = make_batch(4)
    results = []
    for fusion in (False, True):
        model = tiny(None if flavour.endswith("dense") else "switch", backend="torch", seed=5, flavour=flavour)
        model.config.bias_activation_fusion = fusion  # one config object, read by every MLP at forward time
        with _maybe_eager(False), token_ids_context(model, ids_BS):
            loss = model(ids_BS, pos_BS, mask, labels=labels_BS).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    layers = get_flavour(flavour).num_layers
    # every layer's FFN took the fused function (the experts' weighted one in the MoE model), only when fused
    assert calls == ({"SwiGLUFunction": 0, "WeightedSwiGLUFunction": layers} if flavour == "tiny"
                     else {"SwiGLUFunction": layers, "WeightedSwiGLUFunction": 0})
    (loss_u, grads_u), (loss_f, grads_f) = results
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-6, atol=0)
    assert grads_f.keys() == grads_u.keys() and grads_u
    for name, grad in grads_u.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_native_fused_cross_entropy_matches_megatrons_unfused_in_bf16(compiled):
    """megatron's native fused cross-entropy (no TransformerEngine): the bf16 GPU path of the te and torch
    backends. Loss in fp32 and the bf16 logits' gradient as the unfused vocab-parallel cross-entropy."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(6)
    logits_SBV = (3 * torch.randn(SEQ, BATCH, VOCAB, generator=g)).bfloat16()
    labels_SB = torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    grad_SB = torch.rand(SEQ, BATCH, generator=g)
    results = []
    for fused in (False, True):
        leaf = logits_SBV.clone().requires_grad_()
        with _maybe_eager(compiled):
            if fused:
                loss = fused_vocab_parallel_cross_entropy(leaf, labels_SB, parallel_state.get_tensor_model_parallel_group())
            else:
                loss = tensor_parallel.vocab_parallel_cross_entropy(leaf, labels_SB)
            (loss * grad_SB).sum().backward()
        results.append((loss.detach(), leaf.grad))
    (loss_u, grad_u), (loss_f, grad_f) = results
    assert loss_f.dtype == torch.float32 and grad_f.dtype == torch.bfloat16
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_f, grad_u, rtol=1e-2, atol=1e-4)


def test_fusions_follow_the_backend_and_the_device(monkeypatch):
    """megatron's compiled fusions: te and torch backends on a GPU with inductor; never the local backend,
    never on CPU; the fused cross-entropy (bf16 gradients) in bf16 only."""
    import routers.dirmoe_blocks
    from repro.model import builder

    assert not builder.fusions_enabled("torch", on_gpu=False) and not builder.fusions_enabled("local", on_gpu=True)
    monkeypatch.setattr(routers.dirmoe_blocks, "inductor_available", lambda device: (False, "Triton"))
    assert not builder.fusions_enabled("torch", on_gpu=True)
    monkeypatch.setattr(routers.dirmoe_blocks, "inductor_available", lambda device: (True, "Triton"))
    assert builder.fusions_enabled("torch", on_gpu=True) and builder.fusions_enabled("te", on_gpu=True)
    monkeypatch.setattr(builder, "cuda_available", lambda: True)
    bf16 = transformer_config(get_flavour("tiny"), "switch", backend="torch")
    assert bf16.bias_activation_fusion and bf16.cross_entropy_loss_fusion and bf16.cross_entropy_fusion_impl == "native"
    fp32 = transformer_config(get_flavour("tiny"), "switch", backend="torch", bf16=False)
    assert fp32.bias_activation_fusion and not fp32.cross_entropy_loss_fusion
    local = transformer_config(get_flavour("tiny"), "switch", backend="local")
    assert not local.bias_activation_fusion and not local.cross_entropy_loss_fusion


# ------------------------------------------------------------------ the precision harness of tests/test_gpu.py
def _harness_models(router_name="switch"):
    """A tiny fp32 model after a few AdamW steps (non-initial weights) and its bf16 copy (torch backend)."""
    from gpu_harness import train_steps

    S, B = 64, 8  # 64 tokens per expert: one token routed elsewhere in bf16 moves an expert's gradient little

    def data(seed):
        g = torch.Generator().manual_seed(seed)
        ids_BS = torch.randint(0, VOCAB, (B, S), generator=g)
        return ids_BS, torch.arange(S)[None].expand(B, S), causal_attention_mask(S), torch.roll(ids_BS, -1, 1)

    def loss(model, seed):
        ids_BS, pos_BS, mask, labels_BS = data(seed)
        torch.manual_seed(seed)  # the routers' draws, alike in both models
        with token_ids_context(model, ids_BS):
            return model(ids_BS, pos_BS, mask, labels=labels_BS).float().mean()

    fp32 = build_model("tiny", router_name, vocab_size=VOCAB, seq_length=S, seed=0, backend="torch", bf16=False)
    initial = fp32.decoder.layers[0].self_attention.linear_qkv.weight.detach().clone()
    train_steps(fp32, lambda step: loss(fp32, step), steps=6, lr=3e-3)
    moved = fp32.decoder.layers[0].self_attention.linear_qkv.weight.detach() - initial
    assert float(moved.norm() / initial.norm()) > 0.1  # non-initial weights (random tokens: no loss to fall)
    bf16 = build_model("tiny", router_name, vocab_size=VOCAB, seq_length=S, seed=1, backend="torch", bf16=True)
    bf16.load_state_dict(fp32.state_dict())
    for model in (fp32, bf16):
        routers.begin_step(model, 6)
    return fp32, bf16, lambda model: loss(model, 99)


#: CPU, tiny model, 8 x 64 tokens, bf16 against fp32 after 6 steps, measured (torch 2.13 CPU): largest
#: per-tensor error 0.009 (switch, dirmoe), 0.029 (remoe's ReLU router weight), overall 0.004. With 4 x 32
#: tokens one token routed to another expert in bf16 moved switch's expert gradients by 0.09: hence the batch.
#: A gradient 20% off in one tensor (error 0.2) fails the per-tensor bound.
HARNESS_TENSOR_RTOL, HARNESS_OVERALL_RTOL = 0.1, 0.02


def test_precision_harness_passes_bf16_and_catches_a_wrong_gradient(monkeypatch):
    from gpu_harness import (
        MIN_CAPPED_SHARE,
        SMALL_SHARE_CAP,
        TENSOR_CAP,
        bf16_rounded,
        gradient_errors,
        gradient_mismatches,
        model_gradients,
        tensor_bounds,
    )

    from repro.model import torch_backend

    fp32, bf16, loss = _harness_models()
    reference = model_gradients(fp32, loss(fp32))
    bounds = dict(tensor_rtol=HARNESS_TENSOR_RTOL, overall_rtol=HARNESS_OVERALL_RTOL)
    assert gradient_mismatches(model_gradients(bf16, loss(bf16)), reference, **bounds) == []
    assert any("experts.fc1_weight" in name for name in reference)  # the experts are compared too

    # A wrong backward: the SwiGLU gate's gradient lost (the activation's gate detached), bf16 model only.
    unfused = torch_backend.TorchGroupedMLP._activation

    def gate_detached(self, fc1_MG, probs_M):
        gate, up = torch.chunk(fc1_MG, 2, dim=-1)
        return unfused(self, torch.cat([gate.detach(), up], dim=-1), probs_M)

    monkeypatch.setattr(torch_backend.TorchGroupedMLP, "_activation", gate_detached)
    wrong_grads = model_gradients(bf16, loss(bf16))
    wrong = gradient_mismatches(wrong_grads, reference, **bounds)
    monkeypatch.undo()
    assert any("experts.fc1_weight" in line for line in wrong), wrong

    # A gradient 20% too large in one tensor (a missing scale factor, say) fails, however small its share.
    name = "decoder.layers.1.mlp.experts.fc2_weight"
    scaled = dict(model_gradients(bf16, loss(bf16)))
    scaled[name] = scaled[name] * 1.2
    per_tensor, share, _ = gradient_errors(scaled, reference)
    assert share[name] < 1e-2
    assert [line.split(":")[0] for line in gradient_mismatches(scaled, reference, **bounds)] == [name]
    # The routers' own bound applies to their tensors alone: 20% off passes 0.25, 50% off does not (the
    # overall bound left out here: the tiny model's router weights are a large share of its gradient norm).
    router = "decoder.layers.1.mlp.router.router.weight"
    for factor, flagged in ((1.2, []), (1.5, [router])):
        scaled = dict(model_gradients(bf16, loss(bf16)), **{router: reference[router] * factor})
        lines = gradient_mismatches(scaled, reference, tensor_rtol=HARNESS_TENSOR_RTOL, overall_rtol=1.0, router_rtol=0.25)
        assert [line.split(":")[0] for line in lines] == flagged
    # Each tensor's noise floor (fp32 maths on weights rounded to bf16) widens only ill-conditioned tensors'
    # bounds: bf16 still passes, and the wrong backward and the 20% scale are still caught.
    fp32.load_state_dict(bf16_rounded(fp32.state_dict()))
    floor, _, _ = gradient_errors(model_gradients(fp32, loss(fp32)), reference)
    assert 0 < max(floor.values()) < 0.1, floor
    assert gradient_mismatches(model_gradients(bf16, loss(bf16)), reference, **bounds, floor=floor) == []
    assert any("experts.fc1_weight" in line for line in gradient_mismatches(
        wrong_grads, reference, **bounds, floor=floor))
    scaled = dict(model_gradients(bf16, loss(bf16)), **{name: reference[name] * 1.2})
    assert [line.split(":")[0] for line in gradient_mismatches(scaled, reference, **bounds, floor=floor)] == [name]
    # The caps: with its gradient zeroed every tensor fails, and halved every tensor holding MIN_CAPPED_SHARE of
    # the norm or more, even where the floor is large (0.3 everywhere: 4x that alone would pass both); the
    # overall bound left out, so that each line is the per-tensor bound's.
    honest = model_gradients(bf16, loss(bf16))
    _, share, _ = gradient_errors(honest, reference)
    capped = [n for n in reference if share[n] >= MIN_CAPPED_SHARE]
    assert any(".mlp.router." in n for n in capped) and any("experts" in n for n in set(reference) - set(capped))
    per_tensor = dict(tensor_rtol=HARNESS_TENSOR_RTOL, overall_rtol=1.0, router_rtol=0.25)
    for floors in (floor, dict.fromkeys(floor, 0.3)):
        assert gradient_mismatches(honest, reference, **per_tensor, floor=floors) == []
        for n in reference:
            for factor in (0.0, 0.5) if n in capped else (0.0,):
                broken = dict(honest, **{n: honest[n] * factor})
                lines = gradient_mismatches(broken, reference, **per_tensor, floor=floors)
                assert [line.split(":")[0] for line in lines] == [n], (n, factor, lines)
    assert set(tensor_bounds(reference, tensor_rtol=HARNESS_TENSOR_RTOL, floor=dict.fromkeys(floor, 0.3)).values()) == {
        TENSOR_CAP, SMALL_SHARE_CAP}
    with pytest.raises(ValueError, match="different parameters"):
        gradient_errors({}, reference)


def test_step_counters_of_the_gpu_tests_see_what_a_whole_model_step_runs(monkeypatch):
    """tests/test_gpu.py counts the grouped kernel, flash-ready attention and the fused SwiGLU in a bf16
    LLaMA-185M step; the same counters on the tiny model here (fp32, where the CPU kernel runs)."""
    from gpu_harness import step_counters

    from repro.model import backends

    model = tiny("switch", backend="torch", seed=2)
    L = model.config.num_layers
    backends._kernel_self_check("cpu", torch.float32)
    calls = step_counters(monkeypatch)
    ids_BS, pos_BS, mask, labels_BS = make_batch(3)
    with token_ids_context(model, ids_BS):
        model(ids_BS, pos_BS, mask, labels=labels_BS).mean().backward()
    assert len(calls["kernel"]) == 2 * L and calls["loop"] == [] and calls["swiglu"] == []
    assert calls["sdpa"] == [(True, True, torch.float32)] * L
    for key in calls:
        calls[key].clear()
    model.config.bias_activation_fusion = True
    with _maybe_eager(False), token_ids_context(model, ids_BS):
        model(ids_BS, pos_BS, mask, labels=labels_BS).mean().backward()
    assert len(calls["swiglu"]) == L and len(calls["kernel"]) == 2 * L
    monkeypatch.undo()
    assert backends._loop_linear.__name__ == "_loop_linear"  # undone: the real functions are back
