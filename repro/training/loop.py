"""The training loop: megatron-core GPT models with any router, on CPU (gloo) or GPU, one process or torchrun.

One optimizer step (``step`` counts completed steps, from 0):

1. the LR schedule sets the step's learning rate; ``routers.begin_step(model, step)`` tells every router
   the step (its schedules read it in the forward);
2. megatron's ``MoEAuxLossAutoScaler`` gets the loss scale ``1 / num_microbatches`` (megatron's training
   sets the same: the LM loss of each micro-batch is divided by the micro-batch count, and the routers'
   aux losses, attached to the graph through the autoscaler, must be scaled alike);
3. for each of the ``num_microbatches`` micro-batches: forward (inside ``token_ids_context`` so Hash sees
   the ids), mean token loss under the loss mask, backward of ``loss / num_microbatches``;
4. gradients averaged over data-parallel ranks by megatron's ``DistributedDataParallel`` (expert gradients
   over the expert-data-parallel group), clipped to the global norm, AdamW step (torch's on CPU,
   megatron's optimizer on GPU);
5. ``routers.end_step(model, group=dp_group)``: ReMoE's sparsity statistic averaged over layers,
   micro-batches and DP ranks updates its L1 coefficient on every rank alike;
6. one JSON line in ``log.jsonl`` (rank 0), the progress bar, validation and a checkpoint when due.

Outputs in ``out_dir``::

    config.json     the experiment, the process layout, the model's size, the data's origin
    log.jsonl       one record per step (see :data:`LOG_FIELDS`)
    checkpoints/    see :mod:`repro.training.checkpoint`
    summary.json    written when the run reaches its last step (see :func:`summarize`)

Resuming (``resume=True``) takes the newest checkpoint, restores model, optimizer, LR scheduler, RNG
states, data position and step, drops the log lines written after that checkpoint, and continues: the
losses are bit-identical to an uninterrupted run (fp32 on CPU; tested).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from repro.errors import ReproError
from repro.io_utils import atomic_path, write_json_atomic
from repro.training import checkpoint as ckpt
from repro.training.data import RunData, build_run_data, tokenizer_fingerprint
from repro.training.distributed import Parallel, all_reduce_mean, barrier, current_parallel
from repro.training.experiments import Experiment
from repro.training.lr_schedule import LRScheduler, WarmupCosineSchedule
from repro.training.optim import CpuOptimization, MegatronOptimization
from repro.training.synthetic import MicroBatchSampler, collate

#: The fields of a ``log.jsonl`` record (``val_loss`` only on evaluation steps).
LOG_FIELDS: tuple[str, ...] = (
    "step",  # 1-based number of the optimizer step this record describes
    "loss",  # lm_loss + the sum of the aux losses (the objective that was differentiated)
    "lm_loss",  # mean next-token cross-entropy over the step's tokens (mean over micro-batches and DP ranks)
    "aux_losses",  # {name: value summed over layers}, as added to the objective (coefficients applied)
    "aux_losses_per_layer",  # {name: [value per MoE layer]}
    "lr",  # the learning rate used by this step
    "grad_norm",  # global gradient norm before clipping
    "iter_time_s",  # wall time of the step (data, forward, backward, reduction, optimizer, router update)
    "tokens_per_s",  # global tokens of the step / iter_time_s
    "consumed_samples",  # training samples consumed by all ranks after this step
    "active_experts",  # [mean experts per token, per MoE layer]
    "simpson",  # [Simpson index of the combine weights, per MoE layer]
    "router_metrics",  # {metric: [value per MoE layer]} for the other scalar routing metrics
    "router_stats",  # {router: statistic averaged by end_step} (ReMoE's sparsity)
    "peak_memory_bytes",  # peak allocated CUDA memory on GPU; the process's peak RSS on CPU
    "val_loss",  # validation LM loss (evaluation steps only)
)

# Aux losses megatron's own TopKRouter logs divided by their coefficient -> the config field holding it.
_MEGATRON_AUX_COEFF = {
    "load_balancing_loss": "moe_aux_loss_coeff",
    "seq_load_balancing_loss": "moe_aux_loss_coeff",
    "global_load_balancing_loss": "moe_aux_loss_coeff",
    "z_loss": "moe_z_loss_coeff",
}


@dataclass(frozen=True)
class RunPaths:
    """Where a run writes.

    Args:
        root: the output directory.
    """

    root: Path

    @property
    def config(self) -> Path:
        """The experiment and run set-up (JSON)."""
        return self.root / "config.json"

    @property
    def log(self) -> Path:
        """One JSON record per step."""
        return self.root / "log.jsonl"

    @property
    def checkpoints(self) -> Path:
        """The checkpoint directories."""
        return self.root / "checkpoints"

    @property
    def summary(self) -> Path:
        """The final summary (JSON)."""
        return self.root / "summary.json"

    @property
    def data_cache(self) -> Path:
        """megatron's dataset index cache (indexed data only)."""
        return self.root / "data_cache"


@dataclass(frozen=True)
class Precision:
    """Numeric set-up of a run.

    Args:
        device: where the model computes.
        bf16: bf16 parameters and activations (GPU only; the routers keep fp32).
    """

    device: torch.device
    bf16: bool


# ------------------------------------------------------------------------------------------- set-up
def _precision(experiment: Experiment, device: torch.device) -> Precision:
    on_gpu = device.type == "cuda"
    if experiment.precision == "bf16" and not on_gpu:
        raise ReproError(f"experiment '{experiment.name}': precision=bf16 needs a GPU; use --set precision=fp32 on CPU")
    bf16 = experiment.precision == "bf16" or (experiment.precision == "auto" and on_gpu)
    return Precision(device=device, bf16=bf16)


def _seed_everything(seed: int) -> None:
    # Every host-side generator a step may draw from (megatron's CUDA tracker is seeded by init_distributed).
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _build_model(experiment: Experiment, vocab_size: int, seq_length: int, precision: Precision) -> nn.Module:
    from repro.model.builder import build_model

    try:
        flavour = experiment.model_flavour()
        return build_model(
            flavour,
            router_name=experiment.router,
            router_options=experiment.build_router_options() if experiment.router else None,
            vocab_size=vocab_size,
            seq_length=seq_length,
            bf16=precision.bf16,
            seed=experiment.seed,
        )
    except (ValueError, TypeError) as exc:
        raise ReproError(f"experiment '{experiment.name}': cannot build the model: {exc}") from None


def _build_layout_independent(
    experiment: Experiment, vocab_size: int, seq_length: int, precision: Precision, parallel: Parallel
) -> nn.Module:
    """Build the model so that its initial weights do not depend on the expert-parallel layout.

    megatron initialises parameters from torch's generator in construction order, so an EP rank that
    builds only its ``E / ep`` experts draws different values (for its experts and every layer after the
    first MoE layer) than a process building all ``E``. With ``ep > 1`` the full model is therefore built
    once under an EP=1 parallel state (same seed), and each rank keeps the weights of its experts from it.
    The EP run then starts from exactly the one-process model, which makes runs comparable across layouts.
    Costs one extra build (full model memory, briefly); skipped when a checkpoint provides the weights.
    """
    if parallel.ep_size == 1:
        return _build_model(experiment, vocab_size, seq_length, precision)
    from megatron.core import parallel_state

    from repro.model.parallel import init_distributed

    parallel_state.destroy_model_parallel()
    init_distributed(tp=experiment.tp, ep=1, seed=experiment.seed)
    full = _build_model(experiment, vocab_size, seq_length, precision)
    state_global = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in full.state_dict().items()}
    del full
    parallel_state.destroy_model_parallel()
    init_distributed(tp=experiment.tp, ep=experiment.ep, seed=experiment.seed)
    model = _build_model(experiment, vocab_size, seq_length, precision)
    ckpt.load_global_state(model, state_global, current_parallel(), "the EP=1 build of the model")
    return model


def _seq_length(experiment: Experiment) -> int:

    try:
        flavour = experiment.model_flavour()
    except ValueError as exc:
        raise ReproError(f"experiment '{experiment.name}': {exc}") from None
    return experiment.seq_length or flavour.seq_length


def _count_params(model: nn.Module, parallel: Parallel) -> dict[str, int]:
    from repro.training.distributed import split_params

    dense, expert = split_params(model)
    n_dense = sum(p.numel() for p in dense)
    n_expert = sum(p.numel() for p in expert)
    return {"non_expert": n_dense, "expert_local": n_expert, "expert_total": n_expert * parallel.ep_size}


# ----------------------------------------------------------------------------------------- a step
def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _lm_loss(run_model: nn.Module, model: nn.Module, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of one micro-batch under its loss mask (fp32 scalar)."""
    from routers.megatron_adapter import token_ids_context

    with token_ids_context(model, batch["tokens"]):
        per_token_BS = run_model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    loss_mask = batch["loss_mask"]
    return (per_token_BS.float() * loss_mask).sum() / loss_mask.sum().clamp_min(1.0)


def _megatron_aux_losses(model: nn.Module, skip: set[str]) -> dict[str, torch.Tensor]:
    """Per-layer aux losses megatron's own routers logged to its tracker, with coefficients applied."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    config = getattr(model, "config", None)
    out: dict[str, torch.Tensor] = {}
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        if name in skip:
            continue
        coeff = getattr(config, _MEGATRON_AUX_COEFF.get(name, ""), None) if config is not None else None
        if not isinstance(coeff, (int, float)):
            continue  # not one of megatron's (ours are read from the adapters, weighted already)
        out[name] = entry["values"].detach().float().cpu() * float(coeff)
    return out


def _step_measurements(
    model: nn.Module, lm_sum: torch.Tensor, num_microbatches: int
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Everything of one step to average over DP ranks, as named CPU tensors, plus the MoE layer numbers.

    Returns ``{"lm_loss": scalar, "aux/<name>": [L], "metric/<name>": [L]}``.
    """
    from routers.megatron_adapter import collect_aux_losses, collect_routing_metrics

    metrics_by_layer = collect_routing_metrics(model)
    aux_by_layer = collect_aux_losses(model)
    layers = sorted(set(metrics_by_layer) | set(aux_by_layer))
    values: dict[str, torch.Tensor] = {"lm_loss": (lm_sum / num_microbatches).detach().float().cpu().reshape(1)}
    aux_names = sorted({n for per in aux_by_layer.values() for n in per})
    for name in aux_names:
        values[f"aux/{name}"] = torch.stack(
            [aux_by_layer.get(layer, {}).get(name, torch.zeros(())).float().cpu() for layer in layers]
        )
    metric_names = sorted(
        {n for per in metrics_by_layer.values() for n, v in per.items() if v.numel() == 1}
    )
    for name in metric_names:
        values[f"metric/{name}"] = torch.stack(
            [metrics_by_layer.get(layer, {}).get(name, torch.zeros(())).float().cpu().reshape(()) for layer in layers]
        )
    # megatron's TopKRouter (the "megatron" router) logs to its tracker, summed over micro-batches.
    for name, per_layer in _megatron_aux_losses(model, set(aux_names)).items():
        values[f"aux/{name}"] = per_layer / num_microbatches
    return values, layers


def _reduce_named(values: dict[str, torch.Tensor], parallel: Parallel) -> dict[str, torch.Tensor]:
    """Mean of every named tensor over the DP ranks, in one all-reduce (same names on every rank)."""
    if parallel.dp_size <= 1:
        return values
    names = sorted(values)
    flat = torch.cat([values[n].reshape(-1).double() for n in names])
    flat = all_reduce_mean(flat, parallel.dp_group, parallel.dp_size)
    out, offset = {}, 0
    for n in names:
        k = values[n].numel()
        out[n] = flat[offset : offset + k].view_as(values[n]).float()
        offset += k
    return out


def _record(
    step: int,
    reduced: dict[str, torch.Tensor],
    lr: float,
    grad_norm: float,
    iter_time: float,
    tokens: int,
    consumed: int,
    router_stats: dict[str, float],
) -> dict[str, Any]:
    lm_loss = float(reduced["lm_loss"][0])
    aux_per_layer = {k[4:]: [float(x) for x in v] for k, v in reduced.items() if k.startswith("aux/")}
    aux = {k: float(sum(v)) for k, v in aux_per_layer.items()}
    metrics = {k[7:]: [float(x) for x in v] for k, v in reduced.items() if k.startswith("metric/")}
    return {
        "step": step,
        "loss": lm_loss + sum(aux.values()),
        "lm_loss": lm_loss,
        "aux_losses": aux,
        "aux_losses_per_layer": aux_per_layer,
        "lr": lr,
        "grad_norm": grad_norm,
        "iter_time_s": iter_time,
        "tokens_per_s": tokens / iter_time if iter_time > 0 else float("nan"),
        "consumed_samples": consumed,
        "active_experts": metrics.pop("active_experts", []),
        "simpson": metrics.pop("simpson", []),
        "router_metrics": metrics,
        "router_stats": router_stats,
    }


@torch.no_grad()
def evaluate(
    run_model: nn.Module,
    model: nn.Module,
    dataset,
    experiment: Experiment,
    parallel: Parallel,
    mask: torch.Tensor,
    device: torch.device,
) -> float:
    """Mean validation LM loss over ``eval_iters`` micro-batches per rank (the same samples every time).

    Runs in eval mode (routers deterministic) and leaves the training RNG streams as they were; it clears
    the routers' records and megatron's aux-loss tracker afterwards, so evaluation forwards never mix into
    the next training step's log.

    Args:
        run_model: the model to call (megatron's DDP wrapper on GPU).
        model: the unwrapped model (its adapters get the token ids).
        dataset: indexable validation samples.
        experiment: the config (``eval_iters``, ``micro_batch_size``).
        parallel: the layout (the loss is averaged over DP ranks).
        mask: the causal attention mask.
        device: the model's device.

    Returns:
        The validation loss.
    """
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    from routers.megatron_adapter import reset_routing_records

    sampler = MicroBatchSampler(experiment.micro_batch_size, parallel.dp_rank, parallel.dp_size, experiment.eval_iters)
    devices = [device.index or 0] if device.type == "cuda" else []
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    try:
        with torch.random.fork_rng(devices=devices):
            for j in range(experiment.eval_iters):
                batch = _to_device(collate(dataset, sampler.indices(0, j)), device)
                total += _lm_loss(run_model, model, batch, mask).double().cpu()
    finally:
        model.train()
        reset_routing_records(model)
        clear_aux_losses_tracker()
    mean = total / max(1, experiment.eval_iters)
    return float(all_reduce_mean(mean.reshape(1), parallel.dp_group, parallel.dp_size)[0])


# ----------------------------------------------------------------------------------------- logging
def _truncate_log(path: Path, last_step: int) -> None:
    """Keep the log records of steps <= ``last_step`` (a killed run may have logged past its checkpoint)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            break  # a line cut by the kill: nothing after it is trustworthy
        if int(record.get("step", 0)) <= last_step:
            kept.append(line)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``log.jsonl``.

    Args:
        path: the file (or the run's output directory).

    Returns:
        One dict per step, in order.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: list[dict[str, Any]], experiment: Experiment, extra: dict[str, Any]) -> dict[str, Any]:
    """The run's summary from its log records.

    Throughput statistics leave out the first record, whose step includes one-off warm-up costs.

    Args:
        records: the ``log.jsonl`` records.
        experiment: the config.
        extra: more entries (layout, parameter counts, wall time).

    Returns:
        ``{experiment, router, steps, final_loss, final_lm_loss, final_val_loss, tokens_per_s_mean,
        tokens_per_s_median, iter_time_s_mean, tokens, active_experts_final, simpson_final, ...}``.
    """
    timed = records[1:] if len(records) > 1 else records
    last = records[-1] if records else {}
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    tail = records[-min(10, len(records)) :] if records else []
    return {
        "experiment": experiment.name,
        "router": experiment.router or "dense",
        "flavour": experiment.flavour,
        "steps": int(last.get("step", 0)),
        "final_loss": last.get("loss"),
        "final_lm_loss": last.get("lm_loss"),
        "final_loss_mean10": statistics.fmean(r["loss"] for r in tail) if tail else None,
        "final_val_loss": vals[-1] if vals else None,
        "tokens": int(last.get("consumed_samples", 0)) * int(extra.get("seq_length", 0)),
        "tokens_per_s_mean": statistics.fmean(r["tokens_per_s"] for r in timed) if timed else None,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed) if timed else None,
        "iter_time_s_mean": statistics.fmean(r["iter_time_s"] for r in timed) if timed else None,
        "active_experts_final": last.get("active_experts"),
        "simpson_final": last.get("simpson"),
        **extra,
    }


def _check_resume_config(stored: Experiment, given: Experiment | None, where: Path) -> None:
    if given is None or given == stored:
        return
    diffs = [
        f"{f.name}: {getattr(stored, f.name)!r} -> {getattr(given, f.name)!r}"
        for f in dataclasses.fields(Experiment)
        if getattr(stored, f.name) != getattr(given, f.name)
    ]
    raise ReproError(f"{where}: --resume with a different config than the checkpoint's ({'; '.join(diffs)})")


# -------------------------------------------------------------------------------------------- train
def train(
    experiment: Experiment | None,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Train one experiment (every rank calls this under torchrun; a single process works without it).

    Args:
        experiment: the config; with ``resume`` it may be None (the checkpoint's config is used) and
            otherwise must equal the checkpoint's.
        out_dir: the output directory (see the module docstring).
        resume: continue from the newest checkpoint in ``out_dir/checkpoints``.
        stop_after: stop after this many completed steps as if killed: no final checkpoint, no summary
            (for tests of resuming, and for time-boxed jobs followed by ``resume``).
        progress: show a tqdm bar on rank 0 (default: when stderr is a terminal).

    Returns:
        The summary dict (also written to ``summary.json``) when the run completed; with ``stop_after``,
        ``{"stopped_at": step, ...}``.

    Raises:
        ReproError: bad config, an output directory holding another run without ``resume``, a missing or
            corrupt checkpoint with ``resume`` (naming the path), a layout change on resume.
    """
    from repro.model import parallel as model_parallel

    paths = RunPaths(Path(out_dir))
    info: ckpt.CheckpointInfo | None = None
    if resume:
        latest = ckpt.find_latest_checkpoint(paths.checkpoints)
        if latest is None:
            raise ReproError(f"{paths.checkpoints}: no checkpoint to resume from")
        info = ckpt.read_checkpoint_info(latest)
        stored = Experiment.from_dict(info.experiment)
        _check_resume_config(stored, experiment, latest)
        experiment = stored
    else:
        if experiment is None:
            raise ReproError("no experiment given")
        if paths.log.exists() or ckpt.find_latest_checkpoint(paths.checkpoints) is not None:
            raise ReproError(f"{paths.root}: already holds a run; pass --resume to continue it or choose another --out")
    assert experiment is not None

    owns_dist = not model_parallel.is_initialized()
    try:
        pinfo = model_parallel.init_distributed(tp=experiment.tp, ep=experiment.ep, seed=experiment.seed)
    except ValueError as exc:
        raise ReproError(f"experiment '{experiment.name}': {exc}") from None
    try:
        with _aux_loss_scale_restored():
            return _train(experiment, paths, info, pinfo.device, stop_after, progress)
    finally:
        if owns_dist:
            model_parallel.destroy_distributed()


@contextlib.contextmanager
def _aux_loss_scale_restored() -> Iterator[None]:
    """Put megatron's process-wide ``MoEAuxLossAutoScaler`` scale back as it was after training.

    The loop sets it to ``1 / num_microbatches``; left there, it would silently scale the aux-loss
    gradients of any later backward in the process (another run, an evaluation, a test).
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    before = MoEAuxLossAutoScaler.main_loss_backward_scale
    saved = before.detach().clone() if torch.is_tensor(before) else None
    try:
        yield
    finally:
        if saved is None:
            MoEAuxLossAutoScaler.main_loss_backward_scale = None
        else:
            MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def _train(
    experiment: Experiment,
    paths: RunPaths,
    info: ckpt.CheckpointInfo | None,
    device: torch.device,
    stop_after: int | None,
    progress: bool | None,
) -> dict[str, Any]:
    """The body of :func:`train`, with torch.distributed and megatron's parallel state initialised."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker
    from tqdm import tqdm

    from repro.model.cpu_shims import causal_attention_mask
    from routers import begin_step, end_step
    from routers.megatron_adapter import reset_routing_records

    parallel = current_parallel()
    precision = _precision(experiment, device)
    num_microbatches = experiment.num_microbatches(parallel.dp_size)
    seq_length = _seq_length(experiment)
    _seed_everything(experiment.seed)

    if info is not None:
        ckpt.check_same_layout(info, parallel)
    data: RunData = build_run_data(experiment, seq_length, parallel.dp_size, paths.data_cache)
    if info is None and not experiment.init_from and experiment.layout_independent_init:
        model = _build_layout_independent(experiment, data.vocab_size, seq_length, precision, parallel)
        parallel = current_parallel()  # the EP=1 detour re-created megatron's groups
    else:
        model = _build_model(experiment, data.vocab_size, seq_length, precision)

    payload = ckpt.load_rank_payload(info, parallel.rank) if info is not None else None
    if payload is not None:
        model.load_state_dict(payload["model"], strict=True)
    elif experiment.init_from:
        ckpt.load_model_weights(experiment.init_from, model, parallel)
    # Training draws (router noise) start from the same seed whatever the layout or the build's draws.
    _seed_everything(experiment.seed + 1)

    opt_kwargs = dict(
        lr=experiment.lr,
        weight_decay=experiment.weight_decay,
        betas=(experiment.adam_beta1, experiment.adam_beta2),
        eps=experiment.adam_eps,
        clip_grad=experiment.clip_grad,
    )
    if device.type == "cuda":  # pragma: no cover - GPU machines only
        optimization = MegatronOptimization(
            model, parallel, bf16=precision.bf16, distributed_optimizer=experiment.distributed_optimizer, **opt_kwargs
        )
    else:
        optimization = CpuOptimization(model, parallel, **opt_kwargs)
    run_model = optimization.ddp_model  # forward/backward through megatron's DDP wrapper (grad buffers)
    scheduler = LRScheduler(
        optimization,
        WarmupCosineSchedule(experiment.lr, experiment.min_lr, experiment.num_warmup_steps, experiment.steps),
        weight_decay=experiment.weight_decay,
    )

    step, consumed = 0, 0
    if payload is not None:
        optimization.load_state_dict(payload["optimizer"])
        scheduler.load_state_dict(payload["scheduler"])
        step, consumed = int(payload["step"]), int(payload["consumed_samples"])
        # Last: the restored RNG must be exactly the state after the checkpointed step.
        ckpt.restore_rng_state(payload["rng"])
        del payload

    config_record = {
        "experiment": experiment.to_dict(),
        "router_options_resolved": experiment.build_router_options() if experiment.router else {},
        "layout": parallel.layout(),
        "num_microbatches": num_microbatches,
        "seq_length": seq_length,
        "vocab_size": data.vocab_size,
        "data": data.description,
        # Evaluation loads exactly this tokenizer (checked by hash), never a rebuilt one.
        "tokenizer": None
        if data.tokenizer_dir is None
        else {"dir": data.tokenizer_dir, "sha256": tokenizer_fingerprint(data.tokenizer_dir)},
        "device": str(device),
        "precision": "bf16" if precision.bf16 else "fp32",
        "parameters": _count_params(model, parallel),
        "torch": torch.__version__,
    }
    if parallel.is_main:
        paths.root.mkdir(parents=True, exist_ok=True)
        if info is not None:
            _truncate_log(paths.log, step)
        write_json_atomic(paths.config, config_record)
    barrier()

    sampler = MicroBatchSampler(experiment.micro_batch_size, parallel.dp_rank, parallel.dp_size, num_microbatches)
    mask = causal_attention_mask(seq_length, device)
    tokens_per_step = experiment.global_batch_size * seq_length
    loss_scale = torch.tensor(1.0 / num_microbatches, device=device)
    dp_group = parallel.dp_group if parallel.dp_size > 1 else None
    show = parallel.is_main and (progress if progress is not None else os.isatty(2))
    bar = tqdm(total=experiment.steps, initial=step, disable=not show, desc=experiment.name, dynamic_ncols=True)
    log_file = open(paths.log, "a") if parallel.is_main else None  # noqa: SIM115 - closed in finally
    run_start = time.perf_counter()
    stopped = False
    try:
        model.train()
        while step < experiment.steps:
            if stop_after is not None and step >= stop_after:
                stopped = True
                break
            t0 = time.perf_counter()
            lr = scheduler.apply()
            begin_step(model, step)
            MoEAuxLossAutoScaler.set_loss_scale(loss_scale)
            clear_aux_losses_tracker()
            reset_routing_records(model)
            optimization.zero_grad()
            lm_sum = torch.zeros((), device=device)
            for j in range(num_microbatches):
                batch = _to_device(collate(data.train, sampler.indices(consumed, j)), device)
                lm = _lm_loss(run_model, model, batch, mask)
                (lm / num_microbatches).backward()
                lm_sum += lm.detach()
            grad_norm = optimization.step()
            scheduler.step()
            router_stats = end_step(model, group=dp_group)
            if device.type == "cuda":  # pragma: no cover
                torch.cuda.synchronize()
            iter_time = time.perf_counter() - t0
            step += 1
            consumed += experiment.global_batch_size

            values, _ = _step_measurements(model, lm_sum, num_microbatches)
            reduced = _reduce_named(values, parallel)
            record = _record(step, reduced, lr, grad_norm, iter_time, tokens_per_step, consumed, router_stats)
            record["peak_memory_bytes"] = peak_memory_bytes(device)
            if not math.isfinite(record["loss"]):
                raise ReproError(f"experiment '{experiment.name}': loss is {record['loss']} at step {step}")
            clear_aux_losses_tracker()
            reset_routing_records(model)

            if data.valid is not None and experiment.eval_interval and (
                step % experiment.eval_interval == 0 or step == experiment.steps
            ):
                record["val_loss"] = evaluate(run_model, model, data.valid, experiment, parallel, mask, device)

            if log_file is not None:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            bar.update(1)
            if step % experiment.log_interval == 0 or step == experiment.steps:
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")

            if step == experiment.steps or (experiment.checkpoint_interval and step % experiment.checkpoint_interval == 0):
                if log_file is not None:
                    os.fsync(log_file.fileno())
                ckpt.save_checkpoint(
                    paths.checkpoints,
                    step=step,
                    consumed_samples=consumed,
                    parallel=parallel,
                    experiment=experiment.to_dict(),
                    model=model,
                    optimizer_state=optimization.state_dict(),
                    scheduler_state=scheduler.state_dict(),
                )
    finally:
        bar.close()
        if log_file is not None:
            log_file.close()

    if stopped:
        return {"experiment": experiment.name, "stopped_at": step}
    barrier()
    summary = summarize(
        read_log(paths.log) if paths.log.exists() else [],
        experiment,
        {
            "layout": parallel.layout(),
            "device": str(device),
            "precision": "bf16" if precision.bf16 else "fp32",
            "seq_length": seq_length,
            "global_batch_size": experiment.global_batch_size,
            "parameters": config_record["parameters"],
            "wall_time_s_last_segment": time.perf_counter() - run_start,
        },
    )
    if parallel.is_main:
        write_json_atomic(paths.summary, summary)
        _write_run_record(paths.root)
    return summary


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: allocated device memory on CUDA, resident set size on CPU.

    Args:
        device: the training device.

    Returns:
        Bytes (the CPU figure is the process's whole peak RSS: model, optimizer, data and the Python heap).
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    # Linux reports ru_maxrss in KiB.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _write_run_record(run_dir: Path) -> None:
    """``record.json`` of a finished run (efficiency, loss curve, routing); ``repro eval`` adds lm-eval's results.

    The efficiency window skips the first tenth of the logged steps (warm-up: allocator, first iterations).
    """
    from repro.report.records import read_log_jsonl, record_from_run_dir, write_record

    rows = read_log_jsonl(run_dir / "log.jsonl")
    record = record_from_run_dir(run_dir, warmup=max(1, len(rows) // 10) if len(rows) > 1 else 0)
    write_record(record, run_dir / "record.json")

