"""GPU checks of the full-scale path: LLaMA-185M in bf16, the torch backend against the local one, on CUDA.

Skipped without CUDA. Run on a GPU machine with ``nox -s tests-gpu`` (or ``pytest -m gpu tests/test_gpu.py``);
it needs megatron-core 0.16.1 and this project's dependencies in the running environment, no
TransformerEngine, and takes a few minutes on one H100. Self-contained: ``build_model`` plus a short manual
loop with megatron-core's ``DistributedDataParallel`` and ``get_megatron_optimizer`` (fp32 main weights for
the bf16 model, as the full-scale runs use), not the training loop.

Tolerances (bf16 rounds every GEMM output to 8 mantissa bits, ~0.4%):

- bf16 vs fp32, first-step loss on the same weights: relative 5e-3 (:data:`BF16_LOSS_RTOL`);
- torch vs local backend in fp32 (TF32 off): relative L2 error of logits and gradients 1e-4
  (:data:`FP32_REL`); in bf16 the logits 3e-2 (:data:`BF16_REL`) and each training step's loss relative
  1e-2 (:data:`BF16_TRAIN_RTOL`);
- one grouped-experts module against ``SequentialMLP``, one SDPA attention against ``DotProductAttention``,
  bf16 on the GPU: relative L2 error of outputs and gradients 2e-2 (:data:`BF16_MODULE_REL`), fp32 1e-4.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import routers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

FLAVOUR = "llama-185m"
SEQ, BATCH = 1024, 2
VOCAB = 50257  # GPT-2 BPE, padded to 50304 in the model
STEPS = 4
LR = 1e-3

BF16_LOSS_RTOL = 5e-3
FP32_REL = 1e-4
BF16_REL = 3e-2
BF16_TRAIN_RTOL = 1e-2
BF16_MODULE_REL = 2e-2  # one experts module or one attention, bf16, against megatron's on the same inputs


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module", autouse=True)
def distributed():
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from repro.model.parallel import destroy_distributed, init_distributed

    yield init_distributed(tp=1, ep=1, seed=1)
    get_moe_layer_wise_logging_tracker().clear()
    destroy_distributed()


@pytest.fixture(autouse=True)
def free_memory():
    """Each test builds full-size models: give their memory back before the next one."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def no_tf32():
    """fp32 comparisons in true fp32 (cuBLAS may otherwise use TF32 for one side only)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def build(router_name="switch", *, backend="torch", bf16=True, seed=0, **overrides):
    from repro.model.builder import build_model
    from repro.model.flavours import get_flavour

    flavour = get_flavour(FLAVOUR, **overrides) if overrides else FLAVOUR
    return build_model(flavour, router_name, vocab_size=VOCAB, seq_length=SEQ, bf16=bf16, seed=seed, backend=backend)


def batch(seed=0):
    from repro.model.builder import causal_attention_mask

    g = torch.Generator().manual_seed(seed)
    ids_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(_device())
    labels_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(_device())
    pos_BS = torch.arange(SEQ, device=_device())[None].expand(BATCH, SEQ)
    return ids_BS, pos_BS, causal_attention_mask(SEQ, _device()), labels_BS


def lm_loss(model, run_model=None, data=None, noise_seed=0):
    """Mean next-token loss of one batch (the routers' random draws reseeded for comparability)."""
    from routers.megatron_adapter import token_ids_context

    ids_BS, pos_BS, mask, labels_BS = data if data is not None else batch()
    torch.manual_seed(noise_seed)
    with token_ids_context(model, ids_BS):
        return (run_model or model)(ids_BS, pos_BS, mask, labels=labels_BS).float().mean()


def logits(model, data=None):
    from routers.megatron_adapter import token_ids_context

    ids_BS, pos_BS, mask, _ = data if data is not None else batch()
    torch.manual_seed(0)
    with torch.no_grad(), token_ids_context(model, ids_BS):
        return model(ids_BS, pos_BS, mask).float()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30))


def megatron_optimization(model, lr=LR, bf16=True):
    """megatron-core's DDP wrapper and optimizer, as the GPU training path builds them.

    ``use_gloo_process_groups=False``: on GPU ``init_distributed`` creates NCCL groups only, and the
    optimizer's default asks for gloo data-parallel groups (an AssertionError otherwise).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        module=model,
    )
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=1.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=False,
    )
    return ddp, get_megatron_optimizer(config, [ddp], use_gloo_process_groups=False)


def train(model, steps=STEPS, data=None):
    """``steps`` optimizer steps on one batch (so the loss must fall); returns the losses and grad norms."""
    from megatron.core.distributed import finalize_model_grads

    ddp, optimizer = megatron_optimization(model)
    data = data if data is not None else batch()
    losses, norms = [], []
    for step in range(steps):
        routers.begin_step(model, step)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = lm_loss(model, ddp, data, noise_seed=1000 + step)
        loss.backward()
        finalize_model_grads([ddp])
        ok, grad_norm, _ = optimizer.step()
        assert ok, f"step {step}: the optimizer skipped the update"
        routers.end_step(model)
        losses.append(float(loss))
        norms.append(float(grad_norm))
    del ddp, optimizer
    return losses, norms


# ----------------------------------------------------------------------------- kernels alone
def _needs_grouped_kernel():
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        pytest.skip(f"torch's grouped GEMM kernel runs on sm90/sm100 only (this GPU: sm{major}x)")


def test_grouped_experts_take_the_kernel_and_match_sequential_mlp_on_gpu():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from repro.model.backends import TorchBackendOptions, grouped_mm_unusable_reason
    from repro.model.builder import transformer_config
    from repro.model.torch_backend import TorchGroupedMLP

    _needs_grouped_kernel()
    config = transformer_config(FLAVOUR, "switch", bf16=True, backend="local")
    E = config.num_moe_experts
    pg = get_default_pg_collection()
    reference = SequentialMLP(
        E, config, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), pg_collection=pg
    )
    ours = TorchGroupedMLP(E, config, pg_collection=pg, options=TorchBackendOptions(expert_gemm="grouped_mm"))
    ours.load_state_dict(reference.state_dict())
    assert ours.fc1_weight.device == _device() and ours.fc1_weight.dtype == torch.bfloat16
    for counts in ([700, 0, 300, 1500, 1, 0, 900, 444], [0, 0, 3000, 0, 0, 0, 0, 0], [256] * E):
        M = sum(counts)
        g = torch.Generator().manual_seed(M)
        x = torch.randn(M, config.hidden_size, generator=g).to(_device(), torch.bfloat16)
        probs = torch.rand(M, generator=g).to(_device())
        assert grouped_mm_unusable_reason(x, ours.fc1_weight) is None
        assert ours.use_grouped_kernel(x)
        results = []
        for module in (reference, ours):
            module.zero_grad(set_to_none=True)
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            out, _ = module(xi, torch.tensor(counts), pi)
            (out.float() * torch.linspace(-1, 1, config.hidden_size, device=_device())).sum().backward()
            results.append((out, xi.grad, pi.grad))
        for actual, expected in zip(results[1], results[0]):
            assert rel_err(actual, expected) < BF16_MODULE_REL
        fc1_ref = torch.stack([e.linear_fc1.weight.grad for e in reference.local_experts])
        fc2_ref = torch.stack([e.linear_fc2.weight.grad for e in reference.local_experts])
        assert rel_err(ours.fc1_weight.grad, fc1_ref) < BF16_MODULE_REL
        assert rel_err(ours.fc2_weight.grad, fc2_ref) < BF16_MODULE_REL
        for e, c in enumerate(counts):
            if c == 0:
                assert not ours.fc1_weight.grad[e].any() and not ours.fc2_weight.grad[e].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdpa_attention_matches_dot_product_attention_on_gpu(dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from repro.model.builder import causal_attention_mask, transformer_config
    from repro.model.torch_backend import TorchSDPAttention

    config = transformer_config(FLAVOUR, "switch", bf16=dtype == torch.bfloat16, backend="local")
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    reference, ours = DotProductAttention(**kwargs), TorchSDPAttention(**kwargs)
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    g = torch.Generator().manual_seed(0)
    shapes = ((SEQ, BATCH, heads, d), (SEQ, BATCH, groups, d), (SEQ, BATCH, groups, d))
    qkv = [torch.randn(s, generator=g).to(_device(), dtype) for s in shapes]
    mask = causal_attention_mask(SEQ, _device())
    results = []
    with no_tf32():
        for module in (reference, ours):
            leaves = [t.clone().requires_grad_() for t in qkv]
            out = module(*leaves, mask)
            (out.float() * torch.linspace(-1, 1, out.shape[-1], device=_device())).sum().backward()
            results.append([out, *(t.grad for t in leaves)])
    tol = BF16_MODULE_REL if dtype == torch.bfloat16 else FP32_REL
    for actual, expected in zip(results[1], results[0]):
        assert actual.dtype == dtype and rel_err(actual, expected) < tol


# ---------------------------------------------------------------------------- whole models
#: The suite's own routers (routers/, baselines/); routers other test modules register are left out.
SUITE_ROUTERS = [
    name for name in routers.available_routers() if routers.router_class(name).__module__.split(".")[0] in ("routers", "baselines")
]


@pytest.mark.parametrize("router_name", SUITE_ROUTERS)
def test_every_router_trains_llama_185m_in_bf16(router_name):
    from repro.model.backends import resolve_backend
    from routers.megatron_adapter import router_adapters

    model = build(router_name, backend="auto")
    assert model.backend == resolve_backend("auto")
    adapters = router_adapters(model)
    assert len(adapters) == model.config.num_layers
    # bf16 model, fp32 router maths: the routers' parameters and their output probs stay float32.
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.dtype == torch.bfloat16
    for adapter in adapters:
        assert all(p.dtype == torch.float32 for p in adapter.router.parameters())
    probs_dtypes = []
    hooks = [a.register_forward_hook(lambda m, i, out: probs_dtypes.append(out[0].dtype)) for a in adapters]
    losses, norms = train(model)
    for hook in hooks:
        hook.remove()
    assert probs_dtypes and set(probs_dtypes) == {torch.float32}
    assert all(torch.isfinite(torch.tensor(losses))) and all(torch.isfinite(torch.tensor(norms))), (losses, norms)
    assert losses[-1] < 0.98 * losses[0], f"{router_name}: loss did not fall: {losses}"


@pytest.mark.parametrize("router_name", ["switch", "remoe"])
def test_bf16_first_step_loss_matches_fp32(router_name):
    fp32 = build(router_name, bf16=False, seed=3)
    with no_tf32():
        loss_fp32 = float(lm_loss(fp32))
    state = {k: v for k, v in fp32.state_dict().items()}
    del fp32
    bf16 = build(router_name, bf16=True, seed=4)
    bf16.load_state_dict(state)  # the same weights, rounded to bf16 (routers stay fp32)
    loss_bf16 = float(lm_loss(bf16))
    assert abs(loss_bf16 - loss_fp32) <= BF16_LOSS_RTOL * abs(loss_fp32), (loss_bf16, loss_fp32)


def test_same_seed_same_initial_weights_on_gpu_backends():
    local, fast = build("switch", backend="local", seed=7), build("switch", backend="torch", seed=7)
    fast_state = fast.state_dict()
    for name, value in local.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, fast_state[name]), name


def test_torch_backend_matches_local_in_fp32_on_gpu():
    from repro.model.torch_backend import TorchGroupedMLP, TorchSDPAttention

    local, fast = build("remoe", backend="local", bf16=False), build("remoe", backend="torch", bf16=False)
    assert isinstance(fast.decoder.layers[0].mlp.experts, TorchGroupedMLP)
    assert isinstance(fast.decoder.layers[0].self_attention.core_attention, TorchSDPAttention)
    fast.load_state_dict(local.state_dict())
    with no_tf32():
        assert rel_err(logits(fast), logits(local)) < FP32_REL
        grads = {}
        for name, model in (("local", local), ("torch", fast)):
            model.zero_grad(set_to_none=True)
            lm_loss(model).backward()
            grads[name] = {n: p.grad for n, p in model.named_parameters() if "experts" not in n}
            layer0 = model.decoder.layers[0].mlp.experts
            grads[name]["fc2"] = (
                layer0.fc2_weight.grad
                if name == "torch"
                else torch.stack([e.linear_fc2.weight.grad for e in layer0.local_experts])
            )
    assert grads["torch"].keys() == grads["local"].keys()
    for key, expected in grads["local"].items():
        if expected is None:
            assert grads["torch"][key] is None, key
        else:
            assert rel_err(grads["torch"][key], expected) < FP32_REL, key


def test_torch_backend_matches_local_in_bf16_training_on_gpu():
    local, fast = build("switch", backend="local"), build("switch", backend="torch")
    fast.load_state_dict(local.state_dict())
    assert rel_err(logits(fast), logits(local)) < BF16_REL
    data = batch(5)
    local_losses, _ = train(local, data=data)
    del local
    gc.collect()
    fast_losses, _ = train(fast, data=data)
    for step, (a, b) in enumerate(zip(fast_losses, local_losses)):
        assert abs(a - b) <= BF16_TRAIN_RTOL * abs(b), (step, fast_losses, local_losses)
    assert fast_losses[-1] < fast_losses[0]


def test_alltoall_dispatcher_with_expert_parallel_1():
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

    alltoall = build("dirmoe", backend="torch", seed=9)
    assert alltoall.config.moe_token_dispatcher_type == "alltoall" and alltoall.config.expert_model_parallel_size == 1
    assert isinstance(alltoall.decoder.layers[0].mlp.token_dispatcher, MoEAlltoAllTokenDispatcher)
    allgather = build("dirmoe", backend="torch", seed=9, token_dispatcher="allgather")
    assert isinstance(allgather.decoder.layers[0].mlp.token_dispatcher, MoEAllGatherTokenDispatcher)
    allgather.load_state_dict(alltoall.state_dict())
    # DirMoE routes a variable number of experts per token: both dispatchers must give the same model.
    a, b = float(lm_loss(alltoall)), float(lm_loss(allgather))
    assert abs(a - b) <= 1e-3 * abs(b), (a, b)
    losses, _ = train(alltoall, steps=2)
    assert all(torch.isfinite(torch.tensor(losses)))
