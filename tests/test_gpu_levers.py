"""GPU checks of the two device-efficiency options whose CPU parity is in tests/test_levers.py.

Skipped without CUDA; the cut-cross-entropy checks also without the package (``pip install -e '.[fused]'``,
offline: ``nox -s wheelhouse -- --extras fused``) and Triton. Run with ``pytest -m gpu tests/test_gpu_levers.py``
(a minute or two on one H100).

- ``model.fused_cross_entropy`` (``cce``, ``torch_compile``) on LLaMA-185M's output-layer shapes in bf16
  (2 x 1024 tokens, h 768, the padded GPT-2 vocabulary 50304), against the fp32 loss of the same bf16 inputs:
  per-token losses within absolute :data:`BF16_LOSS_ATOL` (bf16 logits round to 8 bits: ~1e-2 on a logit of 2,
  which moves a loss of ~11 by less), megatron's own bf16 path within the same bound, gradients of the hidden
  states and the weight within relative L2 :data:`BF16_GRAD_REL`. ``cce_filtered`` is held to the loss only:
  its backward skips softmax entries below bf16 eps / 32 = 2.4e-4 by design, and near-uniform softmax over
  50304 tokens (~2e-5 each, an untrained model) is mostly below it.
- the whole LLaMA-185M model (Switch, bf16) with ``cce`` against megatron's path on the same weights and batch
  (the same hidden states: only the loss differs): per-token losses within :data:`BF16_LOSS_ATOL`, the mean
  within relative :data:`BF16_MODEL_RTOL`; cut-cross-entropy's function was called, once.
- ``optimizer.foreach_fallbacks`` on CUDA tensors: the norm within relative 1e-6 of megatron's fallback, the
  scale bit for bit, and no synchronisation (``torch.cuda.set_sync_debug_mode("error")`` raises on one, as it
  does in megatron's fallback).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_harness import gpu_distributed, gpu_free_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

SEQ, BATCH, HIDDEN, PADDED_VOCAB = 1024, 2, 768, 50304
VOCAB = 50257
BF16_LOSS_ATOL = 2e-2
BF16_GRAD_REL = 2e-2
BF16_MODEL_RTOL = 5e-3


def _cce_available() -> bool:
    try:
        import cut_cross_entropy.cce  # noqa: F401  (imports Triton)
    except ImportError:
        return False
    return True


needs_cce = pytest.mark.skipif(
    not _cce_available(), reason="cut-cross-entropy==25.1.1 with Triton is not installed (pip install -e '.[fused]')"
)


# One process group per file; each test's models freed, and a test that leaks them fails.
distributed = gpu_distributed
free_memory = gpu_free_memory


def _inputs(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=g).bfloat16()  # an RMSNorm's output scale
    weight = (torch.randn(PADDED_VOCAB, HIDDEN, device="cuda", generator=g) * 0.05).bfloat16()  # logits ~N(0, 1.4)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    upstream = torch.rand(BATCH, SEQ, device="cuda", generator=g)
    return hidden, weight, labels, upstream


def _run(loss_fn, hidden, weight, labels, upstream):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = loss_fn(h, w, labels)
    (loss.float() * upstream).sum().backward()
    return loss.detach().float(), h.grad.float(), w.grad.float()


def _fp32_reference(h, w, labels):
    logits = h.float() @ w.float().T  # [S, B, V]
    return F.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")  # [B, S]


def _megatron_bf16(h, w, labels):
    from megatron.core import tensor_parallel

    return tensor_parallel.vocab_parallel_cross_entropy(h @ w.T, labels.T.contiguous()).T


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("impl", [pytest.param("cce", marks=needs_cce), "torch_compile",
                                  pytest.param("cce_filtered", marks=needs_cce)])
def test_fused_cross_entropy_matches_the_unfused_loss_in_bf16(impl, monkeypatch):
    from repro.model import fused_loss

    calls = []
    if impl.startswith("cce"):
        import cut_cross_entropy.cce as cce_module

        apply = cce_module.linear_cross_entropy_apply
        monkeypatch.setattr(cce_module, "linear_cross_entropy_apply", lambda *a: calls.append(a) or apply(*a))
    else:
        compiled = fused_loss._compiled_linear_cross_entropy
        monkeypatch.setattr(fused_loss, "_compiled_linear_cross_entropy", lambda *a: calls.append(a) or compiled(*a))

    inputs = _inputs()
    ref_loss, ref_dh, ref_dw = _run(_fp32_reference, *inputs)
    meg_loss, _, _ = _run(_megatron_bf16, *inputs)
    loss, dh, dw = _run(lambda h, w, y: fused_loss.fused_linear_cross_entropy(h, w, y, impl), *inputs)
    assert len(calls) == 1
    assert loss.shape == (BATCH, SEQ)
    assert (loss - ref_loss).abs().max() <= BF16_LOSS_ATOL
    assert (meg_loss - ref_loss).abs().max() <= BF16_LOSS_ATOL  # the bound holds megatron's own bf16 path too
    if impl != "cce_filtered":
        assert _rel(dh, ref_dh) <= BF16_GRAD_REL, _rel(dh, ref_dh)
        assert _rel(dw, ref_dw) <= BF16_GRAD_REL, _rel(dw, ref_dw)


@needs_cce
def test_our_torch_compile_impl_is_cut_cross_entropys():
    from cut_cross_entropy.torch_compile import torch_compile_linear_cross_entropy

    from repro.model.fused_loss import fused_linear_cross_entropy

    hidden, weight, labels, _ = _inputs(1)
    ours = fused_linear_cross_entropy(hidden, weight, labels, "torch_compile")
    theirs = torch_compile_linear_cross_entropy(hidden.transpose(0, 1), weight, labels, reduction="none")
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-5)


@needs_cce
def test_llama_185m_with_cce_matches_megatrons_loss(monkeypatch):
    import cut_cross_entropy.cce as cce_module

    from repro.model.builder import build_model, causal_attention_mask
    from repro.model.fused_loss import FusedLossGPTModel
    from routers.megatron_adapter import token_ids_context

    calls = []
    apply = cce_module.linear_cross_entropy_apply
    monkeypatch.setattr(cce_module, "linear_cross_entropy_apply", lambda *a: calls.append(a) or apply(*a))
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    pos = torch.arange(SEQ, device="cuda")[None].expand(BATCH, SEQ)
    mask = causal_attention_mask(SEQ, "cuda")
    losses = {}
    for impl in ("none", "cce"):
        model = build_model("185m", "switch", vocab_size=VOCAB, seed=3, fused_cross_entropy=impl)
        assert isinstance(model, FusedLossGPTModel) == (impl == "cce")
        with token_ids_context(model, ids):
            loss = model(ids, pos, mask, labels=labels)
        loss.float().mean().backward()
        assert model.output_layer.weight.grad is not None
        losses[impl] = loss.detach().float()
        del model, loss
    assert len(calls) == 1
    assert (losses["cce"] - losses["none"]).abs().max() <= BF16_LOSS_ATOL
    assert losses["cce"].mean().item() == pytest.approx(losses["none"].mean().item(), rel=BF16_MODEL_RTOL)


def test_foreach_fallbacks_on_cuda_match_megatron_without_a_sync():
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from repro.training.optim import foreach_multi_tensor_l2_norm, foreach_multi_tensor_scale

    g = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(shape, device="cuda", generator=g) for shape in [(768,), (768, 768), (50304, 768), (3, 4)]]
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours, _ = foreach_multi_tensor_l2_norm(0, flag, [grads], False)
        scaled = [t.clone() for t in grads]
        foreach_multi_tensor_scale(0, flag, [scaled, scaled], 0.37)
        bf16 = [torch.empty_like(t, dtype=torch.bfloat16) for t in grads]
        foreach_multi_tensor_scale(0, flag, [grads, bf16], 1.0)
        with pytest.raises(RuntimeError):
            local_multi_tensor_l2_norm(0, flag, [grads], False)  # its per-tensor device-to-host copies
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    theirs, _ = local_multi_tensor_l2_norm(0, flag, [grads], False)
    assert ours.device == theirs.device and ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    expected = [t.clone() for t in grads]
    local_multi_tensor_scale(0, flag, [expected, expected], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(scaled, expected))
    expected_bf16 = [torch.empty_like(t, dtype=torch.bfloat16) for t in grads]
    local_multi_tensor_scale(0, flag, [grads, expected_bf16], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(bf16, expected_bf16))
