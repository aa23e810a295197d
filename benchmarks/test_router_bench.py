"""Router micro-benchmarks: forward + backward of every registered router at T=4096, D=768, E=8, k=1, CPU fp32.

Run with ``nox -s bench`` (results in results/bench/routers.json and a summary table). Skipped in the
unit-test run (``--benchmark-skip`` in pyproject.toml): speed is a benchmark, never a timed unit test.
"""

from __future__ import annotations

import pytest
import torch

import routers

T, D, E, K = 4096, 768, 8, 1
SEQ, BATCH = 1024, 4  # T tokens laid out as megatron's [s, b]
VOCAB = 50304


@pytest.mark.parametrize("name", routers.available_routers())
def test_router_forward_backward(benchmark, name):
    torch.manual_seed(0)
    router = routers.build_router(name, hidden_size=D, num_experts=E, top_k=K).train()
    hidden_TD = torch.randn(T, D, requires_grad=True)
    token_ids_T = torch.randint(0, VOCAB, (T,))
    signal_TE = torch.randn(T, E)  # stands in for the experts' outputs downstream

    def step():
        router.zero_grad(set_to_none=True)
        hidden_TD.grad = None
        out = router(hidden_TD, token_ids_T, (SEQ, BATCH))
        loss = (out.probs * signal_TE).sum() + out.total_aux_loss()
        if loss.requires_grad:
            loss.backward()
        return out

    benchmark.group = f"router fwd+bwd T={T} D={D} E={E} k={K}"
    benchmark.extra_info.update(router=name, tokens=T, hidden=D, experts=E, top_k=K, threads=torch.get_num_threads())
    benchmark.pedantic(step, rounds=10, warmup_rounds=2, iterations=1)
