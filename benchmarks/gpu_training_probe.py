"""The loss trajectories behind ``tests/test_gpu.py``'s training checks' learning rate (a measurement, not a test).

    PYTHONPATH=.:tests python benchmarks/gpu_training_probe.py > probe.log              # on a CUDA GPU
    PYTHONPATH=.:tests python benchmarks/gpu_training_probe.py --cpu > cpu-probe.log    # on any machine

On a GPU: the GPU tests' own training loop (``test_gpu.train``: megatron-core's DDP and optimizer, bf16
LLaMA-185M, one repeated batch of 2 x 1024 tokens) for 8 steps at the recipe's peak learning rate 1e-3 and at
3e-4, for the routers and backends those checks use. With ``--cpu``: the same model and batches in fp32 on the
CPU, megatron's local backend and torch's AdamW (megatron's optimizer needs CUDA; ``gpu_harness.train_steps``),
4 steps at 1e-3: whether a loss jump seen on the GPU is the GPU's or the recipe's. Prints each run's losses.
"""

from __future__ import annotations

import argparse
import time
import warnings

import test_gpu as T
import torch
from gpu_harness import train_steps

from repro.model.parallel import init_distributed

RUNS = (("auxfree", "auto", 0), ("switch", "torch", 5), ("switch", "local", 5), ("dirmoe", "auto", 0), ("remoe", "auto", 0))
CPU_RUNS = (("auxfree", "local", 0), ("switch", "local", 0), ("switch", "local", 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="fp32 on the CPU, torch's AdamW, 4 steps at 1e-3")
    cpu = parser.parse_args().cpu
    warnings.filterwarnings("ignore")
    init_distributed(tp=1, ep=1, seed=1)
    for router, backend, data_seed in CPU_RUNS if cpu else RUNS:
        for lr in (1e-3,) if cpu else (1e-3, 3e-4):
            start = time.perf_counter()
            model = T.build(router, backend=backend, bf16=not cpu)
            data = T.batch(data_seed)
            if cpu:
                def loss(step, model=model, data=data):
                    return T.lm_loss(model, None, data, noise_seed=1000 + step)

                losses = train_steps(model, loss, 4, lr=lr)
            else:
                losses, _ = T.train(model, steps=8, data=data, lr=lr)
            print(router, backend, f"batch{data_seed}", lr, [round(x, 3) for x in losses],
                  f"{time.perf_counter() - start:.1f}s", flush=True)
            del model
            if not cpu:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
