"""Experts micro-benchmark: megatron's SequentialMLP vs the torch backend's grouped GEMM, forward + backward.

T=2048 tokens routed top-1 over E=8 SwiGLU experts (H=512, F=1024) with an uneven load (one expert empty),
on this machine's default device and dtype (CPU fp32 here). Run alone with
``pytest benchmarks/test_experts_bench.py --benchmark-only --benchmark-enable`` (``nox -s bench`` runs it
with the router benchmarks). Speed is a benchmark, never a timed unit test.
"""

from __future__ import annotations

import pytest
import torch

T, H, F, E = 2048, 512, 1024, 8
# Tokens per expert: uneven, one expert without tokens (as variable-k and Expert Choice routing give).
COUNTS = [640, 384, 320, 256, 192, 160, 96, 0]
assert sum(COUNTS) == T

IMPLEMENTATIONS = ("sequential_mlp", "grouped_mm", "loop")


@pytest.fixture(scope="module")
def parallel_state():
    from repro.model.parallel import destroy_distributed, init_distributed

    yield init_distributed(tp=1, ep=1, seed=1)
    destroy_distributed()


def _experts(impl: str):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from repro.flavours import get_flavour
    from repro.model.backends import TorchBackendOptions
    from repro.model.builder import transformer_config
    from repro.model.torch_backend import TorchGroupedMLP

    flavour = get_flavour("tiny", hidden_size=H, ffn_hidden_size=F, num_experts=E, num_attention_heads=8, num_query_groups=4)
    config = transformer_config(flavour, "switch", backend="local")
    pg = get_default_pg_collection()
    if impl == "sequential_mlp":
        submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        return SequentialMLP(E, config, submodules=submodules, pg_collection=pg)
    return TorchGroupedMLP(E, config, pg_collection=pg, options=TorchBackendOptions(expert_gemm=impl))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_experts_forward_backward(benchmark, parallel_state, impl):
    torch.manual_seed(0)
    experts = _experts(impl)
    x_MH = torch.randn(T, H, requires_grad=True)
    probs_M = torch.rand(T, requires_grad=True)
    counts = torch.tensor(COUNTS)
    signal_MH = torch.randn(T, H)  # stands in for the gradient arriving from the combine step

    def step():
        experts.zero_grad(set_to_none=True)
        x_MH.grad = probs_M.grad = None
        out_MH, _ = experts(x_MH, counts, probs_M)
        (out_MH * signal_MH).sum().backward()

    benchmark.group = f"experts fwd+bwd T={T} H={H} F={F} E={E} top-1 fp32"
    benchmark.extra_info.update(impl=impl, tokens=T, hidden=H, ffn=F, experts=E, threads=torch.get_num_threads())
    benchmark.pedantic(step, rounds=20, warmup_rounds=2, iterations=1)
