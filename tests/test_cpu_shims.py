"""The CPU shims for megatron-core 0.16.1 (repro/model/cpu_shims.py).

Every shim has two sides tested: megatron-core *without* it still fails on this CPU machine (checked in
a fresh interpreter that never imports the shims, so a megatron upgrade that fixes the problem makes the
test fail and the shim can go), and the patched path works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from repro.model import cpu_shims
from repro.model.cpu_shims import apply_cpu_shims, causal_attention_mask
from repro.model.parallel import destroy_distributed, init_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims apply only without CUDA")

REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter with megatron-core unpatched; prints {check: "ok" | "<ExceptionType>: msg"}.
_UNPATCHED_PROBE = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist
import torch.nn.functional as F

results = {}
def check(name, fn):
    try:
        fn()
        results[name] = "ok"
    except BaseException as exc:  # noqa: BLE001 - the probe reports whatever megatron raises
        results[name] = f"{type(exc).__name__}: {str(exc)[:200]}"

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(1, 1)
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer import utils as tutils
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

check("current_device", lambda: torch.cuda.current_device())
check("rng_tracker_regular", lambda: model_parallel_cuda_manual_seed(1))
check("rng_tracker_inference", lambda: model_parallel_cuda_manual_seed(1, inference_rng_tracker=True, force_reset_rng=True))
check("default_causal_mask", lambda: tutils.get_default_causal_mask(4))
results["has_te_general_gemm"] = hasattr(moe_utils, "te_general_gemm")
check("router_gating_linear", lambda: moe_utils.router_gating_linear(torch.randn(3, 4), torch.randn(2, 4), None, torch.float32))
config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
                           moe_router_topk=1, moe_router_pre_softmax=True, moe_token_dispatcher_type="alltoall",
                           add_bias_linear=False)
check("alltoall_dispatcher", lambda: MoEAlltoAllTokenDispatcher(4, [0, 1, 2, 3], config=config,
                                                                pg_collection=get_default_pg_collection()))
print("PROBE" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def unpatched() -> dict[str, object]:
    """What megatron-core does on this machine without the shims (one fresh interpreter, ~5 s)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", _UNPATCHED_PROBE], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE")]
    assert proc.returncode == 0 and lines, f"probe failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("PROBE") :])


@pytest.fixture(scope="module", autouse=True)
def distributed():
    """One-process gloo group + megatron parallel state (applies the shims), torn down afterwards."""
    yield init_distributed(tp=1, ep=1, seed=1)
    destroy_distributed()


def _tiny_moe_config(dispatcher: str):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_token_dispatcher_type=dispatcher,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )


# ---------------------------------------------------------------------------------------- shim 0: scope
def test_shims_are_idempotent_and_marked():
    assert apply_cpu_shims() is True
    before = (torch.cuda.current_device,)
    assert apply_cpu_shims() is True
    assert (torch.cuda.current_device,) == before


def test_shims_are_skipped_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(cpu_shims, "cuda_available", lambda: True)
    assert apply_cpu_shims() is False


# ------------------------------------------------------------------------ shim 1: current_device
def test_current_device_unpatched_raises(unpatched):
    assert unpatched["current_device"].startswith(("AssertionError", "RuntimeError")), unpatched["current_device"]


def test_current_device_patched_is_cpu_and_megatron_buffers_allocate():
    from megatron.core import parallel_state

    assert torch.cuda.current_device() == torch.device("cpu")
    buf = parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "shim-test")
    assert buf.device.type == "cpu" and buf.shape == (2, 3)


# --------------------------------------------------------------------------- shim 2: RNG tracker
def test_rng_tracker_regular_fails_inference_form_works(unpatched):
    assert unpatched["rng_tracker_regular"] != "ok", "megatron's CUDA RNG tracker now works on CPU: drop shim 2"
    assert unpatched["rng_tracker_inference"] == "ok", unpatched["rng_tracker_inference"]


def test_rng_tracker_seeded_fork_is_a_noop_and_cpu_rng_is_seeded():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    cpu_shims.seed_model_parallel_rng(7)
    a = torch.rand(3)
    with get_cuda_rng_tracker().fork():  # dropout in TP regions forks here; must not raise on CPU
        b = torch.rand(3)
    cpu_shims.seed_model_parallel_rng(7)
    torch.testing.assert_close(torch.rand(3), a)
    torch.testing.assert_close(torch.rand(3), b)


# ----------------------------------------------------------------------- shim 3: causal mask
def test_default_causal_mask_unpatched_raises(unpatched):
    assert unpatched["default_causal_mask"] != "ok", "megatron's default causal mask now works on CPU: drop shim 3"


def test_default_causal_mask_patched_equals_explicit_mask():
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    torch.testing.assert_close(fused_softmax.get_default_causal_mask(5), causal_attention_mask(5)[0, 0])
    softmax = fused_softmax.FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )
    scores = torch.randn(2, 3, 5, 5)
    with_none = softmax(scores.clone(), None)
    with_explicit = softmax(scores.clone(), causal_attention_mask(5))
    torch.testing.assert_close(with_none, with_explicit)
    assert (with_explicit[..., 0, 1:] == 0).all(), "the first query must attend only to itself"


def test_default_causal_mask_first_made_while_scoring_still_trains():
    """The mask is cached: one first built under ``torch.inference_mode`` (scoring) must still serve training."""
    from megatron.core.fusions import fused_softmax

    sq = 13  # a length no other test builds, so this test makes the cached mask
    with torch.inference_mode():
        fused_softmax.get_default_causal_mask(sq)
    mask = fused_softmax.get_default_causal_mask(sq)
    assert not mask.is_inference()
    scores = torch.randn(2, sq, sq, requires_grad=True)
    scores.masked_fill(mask, float("-inf")).softmax(-1).sum().backward()  # saves the mask for backward
    assert torch.isfinite(scores.grad).all()


# ------------------------------------------------------------------- shim 4: te_general_gemm
def test_te_general_gemm_unpatched_is_missing_and_router_gating_fails(unpatched):
    assert unpatched["has_te_general_gemm"] is False
    assert unpatched["router_gating_linear"].startswith("NameError"), unpatched["router_gating_linear"]


def test_te_general_gemm_patched_router_gating_is_plain_matmul():
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(out, x @ w.t())
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(6, 3).t() @ x.detach())


# ---------------------------------------------------------------- shim 5: alltoall CUDA stream
def test_alltoall_dispatcher_unpatched_needs_a_cuda_stream(unpatched):
    assert "Stream" in unpatched["alltoall_dispatcher"] or "CUDA" in unpatched["alltoall_dispatcher"], unpatched[
        "alltoall_dispatcher"
    ]


def test_alltoall_dispatcher_patched_matches_allgather():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    outputs = {}
    for dispatcher in ("alltoall", "allgather"):
        config = _tiny_moe_config(dispatcher)
        moe_spec = get_gpt_layer_local_spec(num_experts=4).submodules.mlp
        torch.manual_seed(0)
        layer = build_module(moe_spec, config=config)
        layer.set_layer_number(1)
        hidden = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out, _ = layer(hidden)
        out.sum().backward()
        outputs[dispatcher] = (out.detach(), hidden.grad)
    torch.testing.assert_close(outputs["alltoall"][0], outputs["allgather"][0])
    torch.testing.assert_close(outputs["alltoall"][1], outputs["allgather"][1])


# -------------------------------------------------------------- shim 6: optimizer (not patched)
def test_megatron_optimizer_still_needs_cuda_so_cpu_uses_torch_adamw():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer

    param = torch.nn.Parameter(torch.zeros(2))
    adamw = torch.optim.AdamW([param], lr=1e-3)
    # get_megatron_optimizer builds FP32Optimizer for fp32 without the distributed optimizer.
    with pytest.raises((AssertionError, RuntimeError)):
        FP32Optimizer(adamw, OptimizerConfig(lr=1e-3), lambda _: None)


# ------------------------------------------------------------------ shim 7: cross-entropy maximum (speed)
def _megatron_logits_max(vocab_parallel_logits):
    """megatron-core 0.16.1's ``calculate_logits_max``, as it reads unpatched."""
    vocab_parallel_logits = vocab_parallel_logits.float()
    return vocab_parallel_logits, torch.max(vocab_parallel_logits, dim=-1)[0]


def test_cross_entropy_maximum_unpatched_also_computes_indices():
    """megatron-core still takes max(x, dim) (values and indices): once it takes amax itself, drop the shim."""
    import inspect

    from megatron.core.tensor_parallel import cross_entropy

    assert "logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]" in inspect.getsource(cross_entropy)


def test_cross_entropy_patched_is_bit_identical(monkeypatch):
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    assert VocabParallelCrossEntropy.calculate_logits_max is cpu_shims._amax_logits_max
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 2, 256, generator=g) * 4
    labels = torch.randint(0, 256, (16, 2), generator=g)
    grad = torch.rand(16, 2, generator=g)

    def loss_and_grad():
        leaf = logits.clone().requires_grad_()
        loss = tensor_parallel.vocab_parallel_cross_entropy(leaf, labels)
        loss.backward(grad)
        return loss, leaf.grad

    patched = loss_and_grad()
    monkeypatch.setattr(VocabParallelCrossEntropy, "calculate_logits_max", staticmethod(_megatron_logits_max))
    for a, b in zip(patched, loss_and_grad()):
        assert torch.equal(a, b)
