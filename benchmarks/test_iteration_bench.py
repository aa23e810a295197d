"""Training-iteration benchmark: DirMoE's iteration time over Switch's in the same model, on this machine.

One optimizer step of the trainer (``Trainer.train_step``: every micro-batch's forward and backward, gradient
clipping, the optimizer step and the step's metrics) on the efficiency command's configuration
(``repro.studies.efficiency.efficiency_config``: synthetic tokens, the recipe's micro-batch, no checkpoints): LLaMA-185M
with micro-batch 16 x 4 accumulation steps of 1024 tokens at GPT-2's vocabulary where CUDA is available; on CPU
the ``tiny`` flavour (micro-batch 4 x 2 of 128) at the mini-pile tokenizer's vocabulary, 8192, as the suite
trains it (at GPT-2's 50257 its output layer would be most of the iteration).

* ``test_training_iteration[...]``: dense, Switch, DirMoE eager and DirMoE compiled (one region),
  one model at a time; ``python -m repro report bench`` shows each over Switch ("x switch").
* ``test_dirmoe_over_switch_interleaved``: Switch and DirMoE (default options) built side by side and stepped
  in turn, so a change in the machine's load hits both alike; the median ratio is in the benchmark's
  ``extra_info["dirmoe_over_switch"]`` (the DirMoE paper measured 437.3 / 431.5 = 1.013 on H100s). Two DirMoE
  variants step in the same rounds, to say where its extra time goes (``extra_info["over_switch"]``): top-k
  dispatch (exactly k experts per token: what the threshold rule's variable k costs) and the router compiled as
  one region (what its eager launches cost; where inductor can compile here). Two Switch runs carry work aside on
  every router call, its results dropped (``ASIDE``), so their ratios to Switch say what that work costs inside a
  training step (caches and threads as the step leaves them, which a profile of the router alone understates):
  DirMoE's whole router, and its Dirichlet draw with the draw's implicit gradient alone. Each run's per-round
  ratios to Switch (the same round's Switch step) give a mean and its 95% interval
  (``extra_info["over_switch_per_round"]``), how sure the medians are.

Run with ``pytest benchmarks/test_iteration_bench.py --benchmark-only --benchmark-enable
--benchmark-json=results/bench/iteration.json`` (``nox -s bench`` runs it with the others); on a shared CPU add
``--benchmark-timer=time.process_time``. Speed is a benchmark, never a timed unit test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
from collections.abc import Callable, Iterator

import pytest
import torch

#: Runs: label -> (router, overrides).
RUNS = {
    "dense": ("dense", ()),
    "switch": ("switch", ()),
    "dirmoe": ("dirmoe", ("router.options.compile_elementwise=never",)),
    "dirmoe-compiled": ("dirmoe", ("router.options.compile_elementwise=always",)),
}
#: Switch runs with work aside on every router call (label -> what runs; see _aside_hook).
ASIDE = {
    "switch+dirmoe-router": "a DirMoE router's forward and backward (default options) on the call's input",
    "switch+dirichlet": "the Dirichlet draw and its implicit gradient (torch._sample_dirichlet, torch._dirichlet_grad) "
                        "at the concentrations of a DirMoE router at initialisation",
}
ON_GPU = torch.cuda.is_available()
FLAVOUR = "185m" if ON_GPU else "tiny"
VOCAB = 50257 if ON_GPU else 8192
WARMUP_ROUNDS = 3
ROUNDS = 10 if ON_GPU else 20
#: Rounds of the interleaved benchmark. On a 2-core CPU one round's DirMoE / Switch ratio spreads by about 6%
#: (sd), so 20 rounds give a 95% interval of about +-3% on its mean, too wide to tell 1.03 from 1.05; 100 give
#: about +-1.2%.
INTERLEAVED_ROUNDS = 10 if ON_GPU else 100


@contextlib.contextmanager
def _trainers(runs: dict[str, tuple[str, tuple[str, ...]]], tmp_path, rounds: int = ROUNDS) -> Iterator[dict]:
    """Trainers of ``runs`` (label -> (router, overrides)) for ``rounds`` timed steps after the warm-up, built in
    one megatron parallel state."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from repro.model.parallel import destroy_distributed, init_distributed
    from repro.studies.efficiency import efficiency_config
    from repro.training.run_dir import RunPaths
    from repro.training.trainer import Trainer

    configs = {
        # One step more than are run: the efficiency runs' routing metrics are computed on the first and the last
        # step (logging.metrics_interval), so no measured round computes them.
        label: efficiency_config(
            router, FLAVOUR, steps=WARMUP_ROUNDS + rounds + 1, vocab_size=VOCAB, overrides=overrides
        )
        for label, (router, overrides) in runs.items()
    }
    info = init_distributed(tp=1, ep=1, seed=next(iter(configs.values())).seed)
    scale_before = MoEAuxLossAutoScaler.main_loss_backward_scale
    trainers = {}
    try:
        for label, config in configs.items():
            trainers[label] = Trainer(config, RunPaths(tmp_path / label), None, info.device, progress=False)
            trainers[label].model.train()
        yield trainers
    finally:
        for trainer in trainers.values():
            for component in trainer.components:
                component.close()
        trainers.clear()
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale_before
        destroy_distributed()
        gc.collect()
        if ON_GPU:
            torch.cuda.empty_cache()


def _group(trainer) -> str:
    config = trainer.config
    return (
        f"training iteration {FLAVOUR} micro {config.data.micro_batch_size} x {trainer.num_microbatches} x seq "
        f"{config.seq_length} vocab {VOCAB} ({trainer.device.type})"
    )


@pytest.mark.parametrize("label", RUNS)
def test_training_iteration(benchmark, label, tmp_path):
    with _trainers({label: RUNS[label]}, tmp_path) as trainers:
        trainer = trainers[label]
        benchmark.group = _group(trainer)
        benchmark.extra_info.update(
            router=label, flavour=FLAVOUR, backend=getattr(trainer.model, "backend", None),
            global_batch=trainer.config.data.global_batch_size, seq_length=trainer.seq_length,
            threads=torch.get_num_threads(), overrides=list(RUNS[label][1]),
        )
        benchmark.pedantic(trainer.train_step, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)


def _aside_hook(label: str, switch) -> Callable:
    """A forward hook for the Switch router ``switch`` that runs ``ASIDE[label]``'s work on each call's input and
    drops the results; the DirMoE router it uses has ``switch``'s shape and is not part of the model."""
    import routers

    c = switch.config
    dirmoe = routers.build_router("dirmoe", hidden_size=c.hidden_size, num_experts=c.num_experts, top_k=c.top_k)
    dirmoe = dirmoe.to(switch.step.device).train()
    dirmoe.collect_metrics = False  # as on the timed steps
    alpha: dict[tuple, torch.Tensor] = {}  # input shape -> the DirMoE router's concentrations there (drawn once)

    def hook(module, args, output):
        hidden_TD = args[0].detach()
        with torch.enable_grad():
            if label == "switch+dirmoe-router":
                out = dirmoe(hidden_TD.clone().requires_grad_(), None, args[2] if len(args) > 2 else None)
                (out.probs.sum() + out.total_aux_loss()).backward()
                return
            if hidden_TD.shape not in alpha:
                with torch.no_grad():
                    alpha[hidden_TD.shape] = dirmoe.sample(hidden_TD).alpha_q_TE
            alpha_TE = alpha[hidden_TD.shape]
            torch._dirichlet_grad(torch._sample_dirichlet(alpha_TE), alpha_TE, alpha_TE.sum(-1, keepdim=True))

    return hook


def test_dirmoe_over_switch_interleaved(benchmark, request, tmp_path):
    from pytest_benchmark.utils import load_timer

    from repro.stats import mean_ci
    from routers import routers_in
    from routers.dirmoe_blocks import inductor_available

    timer = load_timer(request.config.getoption("benchmark_timer")).target  # the timer --benchmark-timer names
    device = torch.device("cuda" if ON_GPU else "cpu")
    runs = {"switch": ("switch", ()), "dirmoe": ("dirmoe", ()), "dirmoe-topk": ("dirmoe", ("router.options.dispatch=topk",))}
    if inductor_available(device)[0]:
        runs["dirmoe-compiled"] = RUNS["dirmoe-compiled"]
    runs.update((label, ("switch", ())) for label in ASIDE)
    times: dict[str, list[float]] = {label: [] for label in runs}
    with _trainers(runs, tmp_path, INTERLEAVED_ROUNDS) as trainers:
        for label in ASIDE:
            for router in routers_in(trainers[label].model):
                router.register_forward_hook(_aside_hook(label, router))

        def one_step_each():
            for label, trainer in trainers.items():
                start = timer()
                trainer.train_step()
                times[label].append(timer() - start)

        benchmark.group = _group(trainers["switch"]) + ", in turn"
        benchmark.pedantic(one_step_each, rounds=INTERLEAVED_ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
        # whether the default ("auto") compiled DirMoE on this device
        compiled = routers_in(trainers["dirmoe"].model)[0].compiles_elementwise(trainers["dirmoe"].device)
    medians = {label: statistics.median(values[WARMUP_ROUNDS:]) for label, values in times.items()}
    # Each round's time over Switch's in the same round (a paired design: load that hits a round hits both).
    per_round = {label: [t / s for t, s in zip(values[WARMUP_ROUNDS:], times["switch"][WARMUP_ROUNDS:])]
                 for label, values in times.items() if label != "switch"}
    benchmark.extra_info.update(
        router="switch+dirmoe", flavour=FLAVOUR, dirmoe_over_switch=medians["dirmoe"] / medians["switch"],
        switch_median_s=medians["switch"], dirmoe_median_s=medians["dirmoe"],
        dirmoe_min_over_switch_min=min(times["dirmoe"][WARMUP_ROUNDS:]) / min(times["switch"][WARMUP_ROUNDS:]),
        threads=torch.get_num_threads(), compiled=compiled,
        over_switch={label: median / medians["switch"] for label, median in medians.items() if label != "switch"},
        over_switch_per_round={label: dataclasses.asdict(mean_ci(ratios)) for label, ratios in per_round.items()},
        aside=ASIDE,
    )
