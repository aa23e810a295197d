"""Router micro-benchmarks: forward + backward of every registered router at T=4096, D=768, E=8, k=1, CPU fp32,
plus DirMoE compiled as one region (``compile_elementwise="always"``) beside Switch and eager DirMoE,
there and at the ``tiny`` model's per-layer shape (T=512: micro-batch 4 x sequence 128, D=128).

Run with ``nox -s bench`` (results in results/bench/routers.json and a summary table). Skipped in the
unit-test run (``--benchmark-skip`` in pyproject.toml): speed is a benchmark, never a timed unit test.
DirMoE's compiled rounds start after torch.compile has run (the warm-up rounds compile, on CPU with inductor's
C++ backend: a minute or two).
"""

from __future__ import annotations

import pytest
import torch

import routers

T, D, E, K = 4096, 768, 8, 1
SEQ, BATCH = 1024, 4  # T tokens laid out as megatron's [s, b]
VOCAB = 50304
#: The tiny flavour's router input per layer and micro-batch: (tokens, hidden, [s, b]).
TINY_SHAPE = (512, 128, (128, 4))
#: Runs of the compile comparison: label -> (router, options).
COMPILE_RUNS = {
    "switch": ("switch", {}),
    "dirmoe": ("dirmoe", {"compile_elementwise": "never"}),
    "dirmoe-compiled": ("dirmoe", {"compile_elementwise": "always"}),
}


def _bench_router(benchmark, name, options, tokens, hidden, seq_shape, label):
    torch.manual_seed(0)
    router = routers.build_router(name, hidden_size=hidden, num_experts=E, top_k=K, **options).train()
    hidden_TD = torch.randn(tokens, hidden, requires_grad=True)
    token_ids_T = torch.randint(0, VOCAB, (tokens,))
    signal_TE = torch.randn(tokens, E)  # stands in for the experts' outputs downstream

    def step():
        router.zero_grad(set_to_none=True)
        hidden_TD.grad = None
        out = router(hidden_TD, token_ids_T, seq_shape)
        loss = (out.probs * signal_TE).sum() + out.total_aux_loss()
        if loss.requires_grad:
            loss.backward()
        return out

    benchmark.group = f"router fwd+bwd T={tokens} D={hidden} E={E} k={K}"
    benchmark.extra_info.update(
        router=label, tokens=tokens, hidden=hidden, experts=E, top_k=K, threads=torch.get_num_threads(), **options
    )
    benchmark.pedantic(step, rounds=10, warmup_rounds=2, iterations=1)


@pytest.mark.parametrize("name", routers.available_routers())
def test_router_forward_backward(benchmark, name):
    _bench_router(benchmark, name, {}, T, D, (SEQ, BATCH), name)


def test_dirmoe_compiled_forward_backward(benchmark):
    _bench_router(benchmark, "dirmoe", {"compile_elementwise": "always"}, T, D, (SEQ, BATCH), "dirmoe-compiled")


@pytest.mark.parametrize("label", COMPILE_RUNS)
def test_router_tiny_shape(benchmark, label):
    name, options = COMPILE_RUNS[label]
    tokens, hidden, seq_shape = TINY_SHAPE
    _bench_router(benchmark, name, options, tokens, hidden, seq_shape, label)
