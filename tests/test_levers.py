"""CPU parity of two device-efficiency options (``python -m repro study efficiency --variant LABEL=switch,KEY=VALUE``):

- ``optimizer.foreach_fallbacks``: :func:`repro.training.optim.foreach_multi_tensor_l2_norm` /
  :func:`~repro.training.optim.foreach_multi_tensor_scale` against megatron-core's ``local_multi_tensor_l2_norm``
  / ``local_multi_tensor_scale`` on the same tensors. The norm: fp32 inputs within relative 1e-6 (reduction
  order only); bf16 inputs within relative 1e-2 of megatron's (``torch.norm`` of a bf16 tensor returns bf16:
  8 significant bits, up to 2^-8 relative each, 5.4e-3 measured here) and within 1e-6 of an fp64 reference
  (ours accumulates in fp32, as ``amp_C``'s kernel); inf and NaN propagate
  alike. The scale: bit for bit. Host synchronisations (``aten._local_scalar_dense`` and every read
  :class:`~repro.records.op_counts.OpCounter` sees): none in ours, one per tensor and more in megatron's.
- ``model.fused_cross_entropy=torch_compile``: the tiny fp32 model's per-token losses, and the gradients of the
  hidden states, the output weight and every parameter, against megatron's output layer + cross-entropy, within
  relative 1e-5 / absolute 1e-6 (:data:`FP32_RTOL`, :data:`FP32_ATOL`: fp32 reduction order; a wrong term is
  O(1)). ``cce`` needs Triton on a GPU: tests/test_gpu_levers.py.

megatron's fallbacks hard-code ``device="cuda"`` for their outputs; :class:`_CudaOnCpu` runs them on CPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from repro.config import ModelConfig, OptimizerConfig, RunConfig, apply_overrides
from repro.errors import ReproError
from repro.model.builder import build_model, causal_attention_mask
from repro.model.parallel import destroy_distributed, init_distributed
from repro.records.op_counts import OpCounter
from repro.training.optim import (
    foreach_multi_tensor_l2_norm,
    foreach_multi_tensor_scale,
    foreach_optimizer_fallbacks,
)
from routers.megatron_adapter import token_ids_context

FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
VOCAB, SEQ, BATCH = 1000, 16, 2  # padded to 1024 in the model
SHAPES = [(3,), (17, 5), (2, 3, 4), (1000,), (64, 33), (0,)]


@pytest.fixture(scope="module", autouse=True)
def distributed():
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    yield init_distributed(tp=1, ep=1, seed=1)
    get_moe_layer_wise_logging_tracker().clear()
    destroy_distributed()


class _CudaOnCpu(TorchFunctionMode):
    """Tensors megatron asks for on ``device="cuda"`` made on the CPU (this machine has no CUDA)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _ScalarReads(TorchDispatchMode):
    """Counts host reads of device values: ``aten._local_scalar_dense`` (``.item()``, ``float(t)``), and, through
    :class:`_TensorsIntoTensor`, the tensors ``torch.tensor([t, ...])`` reads one by one (it calls ``item()``
    below the dispatcher, where no mode sees it: on a GPU each is a device-to-host copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._function_mode = _TensorsIntoTensor(self)

    def __enter__(self):
        self._function_mode.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._function_mode.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _TensorsIntoTensor(TorchFunctionMode):
    def __init__(self, reads: _ScalarReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.tensor and args:
            stack = [args[0]]
            while stack:
                item = stack.pop()
                if isinstance(item, torch.Tensor):
                    self.reads.count += item.numel()
                elif isinstance(item, (list, tuple)):
                    stack.extend(item)
        return func(*args, **(kwargs or {}))


def _tensors(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * 10.0 ** (i - 2)).to(dtype) for i, shape in enumerate(SHAPES)]


def _megatron_l2_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    from megatron.core.utils import local_multi_tensor_applier, local_multi_tensor_l2_norm

    with _CudaOnCpu():
        norm, _ = local_multi_tensor_applier(local_multi_tensor_l2_norm, torch.zeros(1, dtype=torch.int), [tensors],
                                             False)
    return norm


def _foreach_l2_norm(tensors: list[torch.Tensor]):
    from megatron.core.utils import local_multi_tensor_applier

    return local_multi_tensor_applier(foreach_multi_tensor_l2_norm, torch.zeros(1, dtype=torch.int), [tensors], False)


# ------------------------------------------------------------------------ optimizer.foreach_fallbacks
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_foreach_l2_norm_matches_megatrons_fallback(dtype, rtol):
    tensors = _tensors(dtype)
    ours, per_tensor = _foreach_l2_norm(tensors)
    assert per_tensor is None and ours.shape == (1,) and ours.dtype == torch.float32 and ours.device == tensors[0].device
    torch.testing.assert_close(ours, _megatron_l2_norm(tensors), rtol=rtol, atol=0)
    exact = torch.cat([t.double().flatten() for t in tensors]).norm()
    torch.testing.assert_close(ours.double(), exact.reshape(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad, expected", [(float("inf"), float("inf")), (float("nan"), float("nan"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_l2_norm_propagates_inf_and_nan_as_megatron(bad, expected, dtype):
    tensors = _tensors(dtype)
    tensors[1][3, 2] = bad
    ours, _ = _foreach_l2_norm(tensors)
    theirs = _megatron_l2_norm(tensors)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    torch.testing.assert_close(ours, torch.tensor([expected]), equal_nan=True)


def test_foreach_l2_norm_of_nothing_is_zero():
    norm, _ = foreach_multi_tensor_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), [[]], False)
    assert torch.equal(norm, torch.zeros(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_l2_norm_reads_nothing_on_the_host_where_megatrons_reads_every_tensor(dtype):
    tensors = _tensors(dtype)
    with _ScalarReads() as reads, OpCounter() as counter:
        _foreach_l2_norm(tensors)
    assert reads.count == 0 and dict(counter.counts.sync_ops) == {}
    with _ScalarReads() as reads:
        _megatron_l2_norm(tensors)
    assert reads.count == len(tensors) + 1  # one per tensor, then the total


@pytest.mark.parametrize("src_dtype, dst_dtype, scale", [
    (torch.float32, torch.float32, 0.37),  # clipping: in place
    (torch.float32, torch.bfloat16, 1.0),  # main parameters -> the bf16 model's
    (torch.bfloat16, torch.float32, 1.0),  # and back
    (torch.float32, torch.bfloat16, 0.5),
])
def test_foreach_scale_is_bit_identical_to_megatrons_fallback(src_dtype, dst_dtype, scale):
    from megatron.core.utils import local_multi_tensor_scale

    src = _tensors(src_dtype)
    src[1][0, 0], src[2][1, 1, 1] = float("inf"), float("nan")
    in_place = src_dtype == dst_dtype
    ours_dst = [t.clone() for t in src] if in_place else [torch.empty_like(t, dtype=dst_dtype) for t in src]
    theirs_dst = [t.clone() for t in src] if in_place else [torch.empty_like(t, dtype=dst_dtype) for t in src]
    with _ScalarReads() as reads:
        foreach_multi_tensor_scale(0, torch.zeros(1), [ours_dst if in_place else src, ours_dst], scale)
    local_multi_tensor_scale(0, torch.zeros(1), [theirs_dst if in_place else src, theirs_dst], scale)
    assert reads.count == 0
    for ours, theirs in zip(ours_dst, theirs_dst):
        assert ours.dtype == dst_dtype
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


def test_megatron_grad_norm_reads_the_host_once_with_the_foreach_fallbacks():
    """megatron's ``get_grad_norm_fp32`` end to end (gloo, one rank): N + 2 scalar reads with its fallback, one
    with ours (its own ``total_norm.item()``, which ``clip_grad_by_total_norm_fp32`` compares in Python), the
    same norm."""
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    grads = _tensors(torch.float32)
    with _CudaOnCpu(), _ScalarReads() as reads:
        theirs = get_grad_norm_fp32(grads)
    assert reads.count == len(grads) + 2
    with foreach_optimizer_fallbacks(), _CudaOnCpu(), _ScalarReads() as reads:
        ours = get_grad_norm_fp32(grads)
    assert reads.count == 1
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_foreach_fallbacks_are_installed_only_inside_the_block():
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    optimizer_module = importlib.import_module("megatron.core.optimizer.optimizer")
    assert clip_grads.l2_norm_impl is local_multi_tensor_l2_norm  # no TE, no Apex here
    with foreach_optimizer_fallbacks(False) as replaced:
        assert replaced == [] and clip_grads.l2_norm_impl is local_multi_tensor_l2_norm
    with pytest.raises(RuntimeError, match="inside"), foreach_optimizer_fallbacks() as replaced:
        assert len(replaced) == 3
        assert clip_grads.l2_norm_impl is foreach_multi_tensor_l2_norm
        assert clip_grads.multi_tensor_scale_impl is foreach_multi_tensor_scale
        assert optimizer_module.multi_tensor_scale_impl is foreach_multi_tensor_scale
        raise RuntimeError("inside")
    assert clip_grads.l2_norm_impl is local_multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is local_multi_tensor_scale
    assert optimizer_module.multi_tensor_scale_impl is local_multi_tensor_scale


def test_foreach_fallbacks_leave_a_fused_kernel_alone(monkeypatch):
    from megatron.core.optimizer import clip_grads

    def fused_kernel(*args):  # stands for TE's / Apex's multi_tensor_l2norm
        raise AssertionError("not called")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", fused_kernel)
    with foreach_optimizer_fallbacks() as replaced:
        assert clip_grads.l2_norm_impl is fused_kernel
        assert "megatron.core.optimizer.clip_grads.l2_norm_impl" not in replaced
    assert clip_grads.l2_norm_impl is fused_kernel


def test_foreach_fallbacks_option_defaults_off_and_is_set_from_the_command_line():
    config = RunConfig(name="t")
    assert config.optimizer.foreach_fallbacks is False
    assert apply_overrides(config, ["optimizer.foreach_fallbacks=true"]).optimizer.foreach_fallbacks is True
    assert OptimizerConfig(foreach_fallbacks=True).foreach_fallbacks


# ------------------------------------------------------------------------ model.fused_cross_entropy
def test_fused_cross_entropy_option_is_validated_and_reaches_build_model():
    config = RunConfig(name="t")
    assert config.model.fused_cross_entropy == "none"
    assert config.model_kwargs()["fused_cross_entropy"] == "none"
    assert apply_overrides(config, ["model.fused_cross_entropy=cce"]).model_kwargs()["fused_cross_entropy"] == "cce"
    with pytest.raises(ValueError, match="none, cce, cce_filtered, torch_compile, got 'liger'"):
        ModelConfig(fused_cross_entropy="liger")
    with pytest.raises(ReproError, match="fused_cross_entropy"):
        apply_overrides(config, ["model.fused_cross_entropy=liger"])
    with pytest.raises(ValueError, match="unknown fused_cross_entropy 'liger' for FusedLossGPTModel; valid: cce,"):
        build_model("tiny", "switch", vocab_size=VOCAB, seq_length=SEQ, fused_cross_entropy="liger")


def _megatron_loss(hidden_SBH, weight_VH, labels_BS):
    from megatron.core import tensor_parallel

    logits_SBV = hidden_SBH @ weight_VH.T
    return tensor_parallel.vocab_parallel_cross_entropy(logits_SBV, labels_BS.T.contiguous()).T.contiguous()


def test_fused_linear_cross_entropy_matches_megatrons_loss_and_gradients():
    from repro.model.fused_loss import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(SEQ, BATCH, 32, generator=g)
    weight = torch.randn(1024, 32, generator=g) * 0.3
    labels_BS = torch.randint(0, 1024, (BATCH, SEQ), generator=g)
    upstream_BS = torch.rand(BATCH, SEQ, generator=g)  # per-token weights, as a loss mask makes
    results = []
    for loss_fn in (_megatron_loss, lambda h, w, y: fused_linear_cross_entropy(h, w, y, "torch_compile")):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss_BS = loss_fn(h, w, labels_BS)
        (loss_BS * upstream_BS).sum().backward()
        results.append((loss_BS.detach(), h.grad, w.grad))
    (ref_loss, ref_dh, ref_dw), (loss, dh, dw) = results
    assert loss.shape == (BATCH, SEQ) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(dh, ref_dh, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(dw, ref_dw, rtol=FP32_RTOL, atol=FP32_ATOL)


def _forward_backward(model, batch):
    ids_BS, pos_BS, mask, labels_BS, upstream_BS = batch
    hidden = {}
    handle = model.decoder.final_layernorm.register_forward_hook(
        lambda module, inputs, output: hidden.__setitem__("SBH", output) or output.retain_grad()
    )
    try:
        with token_ids_context(model, ids_BS):
            loss_BS = model(ids_BS, pos_BS, mask, labels=labels_BS)
        (loss_BS * upstream_BS).sum().backward()
    finally:
        handle.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss_BS.detach(), hidden["SBH"].grad, grads


def test_tiny_model_with_fused_cross_entropy_matches_megatrons_path(monkeypatch):
    from repro.model import fused_loss
    from repro.model.fused_loss import FusedLossGPTModel

    calls = []
    compiled = fused_loss._compiled_linear_cross_entropy
    monkeypatch.setattr(fused_loss, "_compiled_linear_cross_entropy", lambda *a: calls.append(a) or compiled(*a))

    g = torch.Generator().manual_seed(3)
    ids_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    batch = (ids_BS, torch.arange(SEQ)[None].expand(BATCH, SEQ), causal_attention_mask(SEQ), labels_BS,
             torch.rand(BATCH, SEQ, generator=g))
    plain = build_model("tiny", "switch", vocab_size=VOCAB, seq_length=SEQ, seed=5)
    fused = build_model("tiny", "switch", vocab_size=VOCAB, seq_length=SEQ, seed=5, fused_cross_entropy="torch_compile")
    assert type(plain).__name__ == "GPTModel" and isinstance(fused, FusedLossGPTModel)
    assert not fused.share_embeddings_and_output_weights and fused.output_layer.weight.shape == (1024, 128)
    assert plain.state_dict().keys() == fused.state_dict().keys()
    for (name, a), b in zip(plain.state_dict().items(), fused.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name

    ref_loss, ref_dh, ref_grads = _forward_backward(plain, batch)
    loss, dh, grads = _forward_backward(fused, batch)
    assert len(calls) == 1 and calls[0][1] is fused.output_layer.weight  # the loss came from the fused op
    torch.testing.assert_close(loss, ref_loss, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(dh, ref_dh, rtol=FP32_RTOL, atol=FP32_ATOL)
    assert grads.keys() == ref_grads.keys() and "output_layer.weight" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=FP32_RTOL, atol=FP32_ATOL, msg=name)

    # Without labels: megatron's logits, the very same (and the fused op is not called).
    with torch.no_grad(), token_ids_context(plain, ids_BS), token_ids_context(fused, ids_BS):
        assert torch.equal(plain(*batch[:3]), fused(*batch[:3]))
    assert len(calls) == 1


def test_cce_without_triton_says_what_to_install():
    from repro.model.fused_loss import fused_linear_cross_entropy

    if importlib.util.find_spec("triton") is not None and importlib.util.find_spec("cut_cross_entropy") is not None:
        pytest.skip("cut-cross-entropy and Triton are installed: the GPU tests run cce")
    with pytest.raises(RuntimeError, match="fused_cross_entropy=cce needs cut-cross-entropy"):
        fused_linear_cross_entropy(torch.zeros(2, 1, 4), torch.zeros(8, 4), torch.zeros(1, 2, dtype=torch.long), "cce")
