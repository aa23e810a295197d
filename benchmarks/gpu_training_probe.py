"""The loss trajectories behind ``tests/test_gpu.py``'s training checks' learning rate (a measurement, not a test).

    PYTHONPATH=.:tests python benchmarks/gpu_training_probe.py > probe.log

Runs the GPU tests' own training loop (``test_gpu.train``: megatron-core's DDP and optimizer, bf16 LLaMA-185M,
one repeated batch of 2 x 1024 tokens) for 8 steps at the recipe's peak learning rate 1e-3 and at 3e-4, for the
routers and backends those checks use, and prints each run's losses. Needs a CUDA GPU.
"""

from __future__ import annotations

import time
import warnings

import test_gpu as T
import torch

from repro.model.parallel import init_distributed

RUNS = (("auxfree", "auto", 0), ("switch", "torch", 5), ("switch", "local", 5), ("dirmoe", "auto", 0), ("remoe", "auto", 0))


def main() -> None:
    warnings.filterwarnings("ignore")
    init_distributed(tp=1, ep=1, seed=1)
    for router, backend, data_seed in RUNS:
        for lr in (1e-3, 3e-4):
            start = time.perf_counter()
            model = T.build(router, backend=backend)
            losses, _ = T.train(model, steps=8, data=T.batch(data_seed), lr=lr)
            print(router, backend, f"batch{data_seed}", lr, [round(x, 3) for x in losses],
                  f"{time.perf_counter() - start:.1f}s", flush=True)
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
