"""The trainer: megatron-core GPT models with any router, on CPU (gloo) or GPU, one process or torchrun.

``train`` builds a :class:`Trainer` whose :meth:`~Trainer.fit` runs :meth:`~Trainer.train_step` to the last
step, handing each row to the components (:mod:`repro.training.components`). One optimizer step:

1. set the LR; ``routers.begin_step`` passes the step and whether to collect metrics;
2. ``MoEAuxLossAutoScaler`` scale = ``1 / num_microbatches`` (as megatron: aux losses scale like the LM loss);
3. per micro-batch: forward in ``token_ids_context`` (Hash), masked mean loss, backward of loss / microbatches;
4. megatron DDP reduction, global-norm clipping, AdamW;
5. ``routers.end_step`` (ReMoE's L1 coefficient, identical on every rank);
6. the row: losses, aux losses, per-layer routing metrics, DP-averaged in one all-reduce.

Steps 1-5 are timed (docs/efficiency.md). Resume is bit-identical (fp32 CPU; tested).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from repro.config import RunConfig
from repro.errors import ReproError
from repro.io_utils import write_json_atomic
from repro.records.step_log import LogRow, read_rows, summarize, truncate_rows
from repro.training import checkpoint as ckpt
from repro.training.components import Checkpointer, StepLog, Validator
from repro.training.data import MicroBatchSampler, build_run_data, collate, tokenizer_fingerprint
from repro.training.distributed import Parallel, all_reduce_mean, barrier, current_parallel, split_params
from repro.training.optim import CpuOptimization, LRScheduler, MegatronOptimization, WarmupCosineSchedule
from repro.training.run_dir import RunPaths, run_lock, start_state

# Aux losses megatron's own TopKRouter logs divided by their coefficient -> the config field holding it.
_MEGATRON_AUX_COEFF = {
    "load_balancing_loss": "moe_aux_loss_coeff", "seq_load_balancing_loss": "moe_aux_loss_coeff",
    "global_load_balancing_loss": "moe_aux_loss_coeff", "z_loss": "moe_z_loss_coeff",
}


class NonFiniteLoss(ReproError):
    """A step's loss or gradient norm is NaN or infinite."""


def _bf16(config: RunConfig, device: torch.device) -> bool:
    """Whether the run has bf16 parameters and activations (GPU only; the routers keep fp32)."""
    on_gpu = device.type == "cuda"
    if config.model.precision == "bf16" and not on_gpu:
        raise ReproError(f"experiment '{config.name}': model.precision=bf16 needs a GPU; use --set model.precision=fp32")
    return config.model.precision == "bf16" or (config.model.precision == "auto" and on_gpu)


def _seed_everything(seed: int) -> None:
    # Every host-side generator a step may draw from (megatron's CUDA tracker is seeded by init_distributed).
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model_for(config: RunConfig, vocab_size: int, bf16: bool) -> nn.Module:
    """The run's GPTModel with its router (raises ReproError on a bad flavour, router or option)."""
    from repro.model.builder import build_model

    try:
        return build_model(**config.model_kwargs(), vocab_size=vocab_size, seq_length=config.seq_length, bf16=bf16)
    except (ValueError, TypeError) as exc:
        raise ReproError(f"experiment '{config.name}': cannot build the model: {exc}") from None


def _build_layout_independent(config: RunConfig, vocab_size: int, bf16: bool, parallel: Parallel) -> nn.Module:
    """Build with EP-layout-independent initial weights: megatron draws in construction order, so with ``ep > 1``
    the full model is built once under EP=1 and each rank keeps its experts' weights."""
    if parallel.ep_size == 1:
        return build_model_for(config, vocab_size, bf16)
    from megatron.core import parallel_state

    from repro.model.parallel import init_distributed

    parallel_state.destroy_model_parallel()
    init_distributed(tp=config.parallel.tp, ep=1, seed=config.seed)
    full = build_model_for(config, vocab_size, bf16)
    state_global = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in full.state_dict().items()}
    del full
    parallel_state.destroy_model_parallel()
    init_distributed(tp=config.parallel.tp, ep=config.parallel.ep, seed=config.seed)
    model = build_model_for(config, vocab_size, bf16)
    ckpt.load_global_state(model, state_global, current_parallel(), "the EP=1 build of the model")
    return model


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: allocated device memory on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _step_measurements(
    model: nn.Module, lm_sum: torch.Tensor, num_microbatches: int, with_metrics: bool = True
) -> dict[str, torch.Tensor]:
    """Values to DP-average: ``lm_loss [1]``, ``aux/* [L]``, ``metric/* [L]``, ``expert/* [L, E]`` (CPU)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from routers.megatron_adapter import collect_aux_losses, collect_routing_metrics

    metrics_by_layer = collect_routing_metrics(model) if with_metrics else {}
    aux_by_layer = collect_aux_losses(model)
    layers = sorted(set(metrics_by_layer) | set(aux_by_layer))
    values: dict[str, torch.Tensor] = {"lm_loss": (lm_sum / num_microbatches).detach().float().cpu().reshape(1)}
    aux_names = sorted({n for per in aux_by_layer.values() for n in per})
    zero = torch.zeros(())
    for name in aux_names:
        values[f"aux/{name}"] = torch.stack([aux_by_layer.get(l, {}).get(name, zero).float().cpu() for l in layers])
    for name in sorted({n for per in metrics_by_layer.values() for n in per}):
        per_layer = [metrics_by_layer.get(layer, {}).get(name) for layer in layers]
        if any(v is None for v in per_layer) or len({v.numel() for v in per_layer}) != 1:
            continue  # a metric some layers lack or with differing sizes cannot be tabulated per layer
        stacked = torch.stack([v.float().cpu().reshape(-1) for v in per_layer])
        single = stacked.shape[1] == 1
        values[f"metric/{name}" if single else f"expert/{name}"] = stacked.squeeze(1) if single else stacked
    # megatron's TopKRouter (the "megatron" router) logs to its tracker, summed over micro-batches; a name without
    # a coefficient is not one of megatron's (ours are read from the adapters, weighted already).
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        coeff = getattr(getattr(model, "config", None), _MEGATRON_AUX_COEFF.get(name, ""), None)
        if name not in aux_names and isinstance(coeff, (int, float)):
            values[f"aux/{name}"] = entry["values"].detach().float().cpu() * float(coeff) / num_microbatches
    return values


def _reduce_named(values: dict[str, torch.Tensor], parallel: Parallel) -> dict[str, torch.Tensor]:
    """Mean of every named tensor over the DP ranks, in one all-reduce (same names on every rank)."""
    if parallel.dp_size <= 1:
        return values
    names = sorted(values)
    flat = torch.cat([values[n].reshape(-1).double() for n in names])
    parts = all_reduce_mean(flat, parallel.dp_group, parallel.dp_size).split([values[n].numel() for n in names])
    return {n: part.view_as(values[n]).float() for n, part in zip(names, parts)}


def _by_prefix(values: dict[str, torch.Tensor], prefix: str) -> dict[str, list]:
    return {k[len(prefix):]: v.tolist() for k, v in values.items() if k.startswith(prefix)}


class Trainer:
    """One run's model, data, optimizer, schedule and step (needs megatron's parallel state; see :func:`train`).

    Args:
        resume: checkpoint to continue from (None: fresh run).
        device: from :func:`repro.model.parallel.init_distributed`.
        progress: show the progress bar (rank 0; default when stderr is a terminal).
    """

    def __init__(
        self, config: RunConfig, paths: RunPaths, resume: ckpt.CheckpointInfo | None, device: torch.device,
        progress: bool | None = None,
    ) -> None:
        self.config, self.paths, self.device = config, paths, device
        self.parallel = current_parallel()
        self.bf16 = _bf16(config, device)
        self.num_microbatches = config.data.num_microbatches(self.parallel.dp_size)
        self.seq_length = config.seq_length
        _seed_everything(config.seed)
        if resume is not None:
            ckpt.check_same_layout(resume, self.parallel)
            ckpt.check_identity(resume, config.to_dict())
        self.data = build_run_data(config, self.seq_length, self.parallel.dp_size, paths.data_cache)
        if resume is None and not config.checkpoint.init_from and config.checkpoint.layout_independent_init:
            self.model = _build_layout_independent(config, self.data.vocab_size, self.bf16, self.parallel)
            self.parallel = current_parallel()  # the EP=1 detour re-created megatron's groups
        else:
            self.model = build_model_for(config, self.data.vocab_size, self.bf16)
        payload = None
        if resume is not None:
            self._check_backend_unchanged()
            payload = ckpt.load_rank_payload(resume, self.parallel.rank)
            self.model.load_state_dict(payload["model"], strict=True)
        elif config.checkpoint.init_from:
            ckpt.load_model_weights(config.checkpoint.init_from, self.model, self.parallel)
        # Router schedules run at router_step0 + step: init checkpoint's step with init_router_step, else 0.
        self.router_step0 = 0
        if config.checkpoint.init_from and config.checkpoint.init_router_step:
            self.router_step0 = ckpt.read_checkpoint_info(ckpt.resolve_checkpoint(config.checkpoint.init_from)).step
        # Training draws (router noise) start from the same seed whatever the layout or the build's draws.
        _seed_everything(config.seed + 1)
        self.optimization = self._build_optimization()
        self.run_model = self.optimization.ddp_model  # forward/backward through megatron's DDP wrapper
        sched = config.schedule
        schedule = WarmupCosineSchedule(config.optimizer.lr, sched.min_lr, sched.num_warmup_steps, sched.steps)
        self.scheduler = LRScheduler(self.optimization, schedule, weight_decay=config.optimizer.weight_decay)
        self.step, self.consumed = 0, 0  # completed optimizer steps; samples consumed by all ranks together
        self.stopped_by: str | None = None  # the signal that stopped the run early (fit)
        if payload is not None:
            Checkpointer.restore(self, payload)
            del payload
        self._write_config()
        from repro.model.cpu_shims import causal_attention_mask

        par = self.parallel
        self.sampler = MicroBatchSampler(config.data.micro_batch_size, par.dp_rank, par.dp_size, self.num_microbatches)
        self.mask = causal_attention_mask(self.seq_length, device)
        self.loss_scale = torch.tensor(1.0 / self.num_microbatches, device=device)
        self.log = StepLog(
            paths.log, config.logging.interval, config.schedule.steps, self.step, self.parallel.is_main,
            self.parallel.is_main and (progress if progress is not None else os.isatty(2)), config.name,
        )
        self.components = [
            Validator(self.data.valid, config.validation.interval, config.validation.iters, config.schedule.steps),
            self.log,
            Checkpointer(paths.checkpoints, config.checkpoint.interval, config.schedule.steps, self.log),
        ]
        if config.logging.trace_step:
            from repro.training.trace import StepTrace

            self.components.append(StepTrace(paths.root / "trace", config.logging.trace_step, self.parallel.is_main))
        if config.logging.tensorboard:
            from repro.training.tensorboard import TensorBoardLog, tensorboard_dir

            self.components.append(TensorBoardLog(
                tensorboard_dir(paths.root, config.logging.tensorboard_dir), config.logging.interval,
                config.schedule.steps, self.step, self.parallel.is_main,
            ))

    def _check_backend_unchanged(self) -> None:
        """Refuse a resume on another backend (it decides the parameter layout the optimizer state follows)."""
        before = json.loads(self.paths.config.read_text()).get("backend") if self.paths.config.is_file() else None
        now = getattr(self.model, "backend", None)
        if before is not None and before != now:
            raise ReproError(
                f"{self.paths.config}: the run trained with backend '{before}', this machine builds '{now}'; "
                f"resume with --set model.backend={before} where it is available"
            )

    def _build_optimization(self):
        opt = self.config.optimizer
        kwargs = dict(lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                      clip_grad=opt.clip_grad)
        if self.device.type == "cuda":  # pragma: no cover - GPU machines only
            kwargs.update(bf16=self.bf16, distributed_optimizer=opt.distributed,
                          foreach_fallbacks=opt.foreach_fallbacks)
            return MegatronOptimization(self.model, self.parallel, **kwargs)
        return CpuOptimization(self.model, self.parallel, **kwargs)

    def _write_config(self) -> None:
        """``config.json`` (rank 0): the config and what the run resolved from it."""
        data = self.data
        dense, expert = (sum(p.numel() for p in group) for group in split_params(self.model))
        record = {
            "experiment": self.config.to_dict(),
            # Every option's value, the router's defaults included (None where the build fills it: Hash's vocabulary);
            # tuples as lists, other values JSON cannot hold as their str.
            "router_options_resolved": json.loads(json.dumps(self.config.router_options_in_effect(), default=str)),
            "layout": self.parallel.layout(), "num_microbatches": self.num_microbatches, "seq_length": self.seq_length,
            "vocab_size": data.vocab_size, "data": data.description, "similarity_batching": data.similarity,
            # Evaluation loads exactly this tokenizer (checked by hash), never a rebuilt one.
            "tokenizer": None if data.tokenizer_dir is None
            else {"dir": data.tokenizer_dir, "sha256": tokenizer_fingerprint(data.tokenizer_dir)},
            "device": str(self.device), "backend": getattr(self.model, "backend", None),
            "precision": "bf16" if self.bf16 else "fp32",
            "parameters": {"non_expert": dense, "expert_local": expert, "expert_total": expert * self.parallel.ep_size},
            "torch": torch.__version__,
        }
        self.config_record = record
        if self.parallel.is_main:
            self.paths.root.mkdir(parents=True, exist_ok=True)
            truncate_rows(self.paths.log, self.step)  # rows a killed run wrote after its checkpoint
            write_json_atomic(self.paths.config, record)
        barrier()

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def lm_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token loss of one micro-batch under its loss mask (fp32 scalar)."""
        from routers.megatron_adapter import token_ids_context

        with token_ids_context(self.model, batch["tokens"]):
            per_token_BS = self.run_model(batch["tokens"], batch["position_ids"], self.mask, labels=batch["labels"])
        loss_mask = batch["loss_mask"]
        return (per_token_BS.float() * loss_mask).sum() / loss_mask.sum().clamp_min(1.0)

    def train_step(self) -> LogRow:
        """One optimizer step (module docstring); returns its row, raises NonFiniteLoss."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker

        from routers import begin_step, end_step
        from routers.megatron_adapter import reset_routing_stats

        step = self.step + 1
        collect = step == 1 or step % self.config.logging.metrics_interval == 0 or step == self.config.schedule.steps
        # Collated on the host before the timer (it times training only); device copies stay inside it.
        host_batches = [
            collate(self.data.train, self.sampler.indices(self.consumed, j)) for j in range(self.num_microbatches)
        ]
        t0 = time.perf_counter()
        events = None
        if self.device.type == "cuda":  # pragma: no cover - the device's own span of the step
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        lr = self.scheduler.apply()
        begin_step(self.model, self.router_step0 + self.step, collect_metrics=collect)
        MoEAuxLossAutoScaler.set_loss_scale(self.loss_scale)
        clear_aux_losses_tracker()
        reset_routing_stats(self.model)
        self.optimization.zero_grad()
        lm_sum = torch.zeros((), device=self.device)
        for host_batch in host_batches:
            batch = self.to_device(host_batch)
            lm = self.lm_loss(batch)
            (lm / self.num_microbatches).backward()
            lm_sum += lm.detach()
        grad_norm = self.optimization.step()
        self.scheduler.step()
        router_stats = end_step(self.model, group=self.parallel.dp_group if self.parallel.dp_size > 1 else None)
        if events is not None:  # pragma: no cover
            events[1].record()
            torch.cuda.synchronize()
        iter_time = time.perf_counter() - t0
        device_time = events[0].elapsed_time(events[1]) / 1e3 if events is not None else None
        self.step += 1
        self.consumed += self.config.data.global_batch_size

        values = _reduce_named(_step_measurements(self.model, lm_sum, self.num_microbatches, collect), self.parallel)
        clear_aux_losses_tracker()
        reset_routing_stats(self.model)
        aux_per_layer = _by_prefix(values, "aux/")
        aux = {k: float(sum(v)) for k, v in aux_per_layer.items()}
        lm_loss = float(values["lm_loss"][0])
        loss = lm_loss + sum(aux.values())
        for what, value in (("loss", loss), ("gradient norm", grad_norm)):
            if not math.isfinite(value):
                raise NonFiniteLoss(f"experiment '{self.config.name}': {what} is {value} at step {self.step}")
        tokens = self.config.data.global_batch_size * self.seq_length
        return LogRow(
            step=self.step, loss=loss, lm_loss=lm_loss, lr=lr, grad_norm=grad_norm, iter_time_s=iter_time,
            tokens_per_s=tokens / iter_time if iter_time > 0 else 0.0, consumed_samples=self.consumed,
            peak_memory_bytes=peak_memory_bytes(self.device), aux_losses=aux, aux_losses_per_layer=aux_per_layer,
            routing=_by_prefix(values, "metric/"), routing_per_expert=_by_prefix(values, "expert/"),
            # Read on the host only on the steps that log routing (after the timer stopped).
            router_stats={name: float(value) for name, value in router_stats.items()} if collect else {},
            metrics_collected=collect, device_time_s=device_time,
        )

    def fit(self, stop_after: int | None = None) -> bool:
        """Train to the last step (True if reached); ``stop_after`` stops as if killed; stop signals end the run
        after the current step (``stopped_by``; :mod:`repro.training.preemption`)."""
        from repro.training.preemption import StopRequest, stop_run

        last = self.config.schedule.steps
        with StopRequest().installed() as stop:
            self.model.train()
            while self.step < last:
                if stop_after is not None and self.step >= stop_after:
                    return False
                row = self.train_step()
                for component in self.components:
                    row = component.after_step(self, row)
                signum = stop.agreed() if self.step < last else 0  # the last step ends anyway
                if signum:
                    self.stopped_by = stop_run(self, signum)
                    return False
        return True

    def close(self) -> None:
        """Close the components and free the model (``Optimization.release``); also clear the lru_cache of
        ``RotaryEmbedding.forward``, which holds each run's module (memory stays flat over runs)."""
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        for component in self.components:
            component.close()
        self.optimization.release()
        RotaryEmbedding.forward.cache_clear()


@contextlib.contextmanager
def aux_loss_scale_restored() -> Iterator[None]:
    """Restore megatron's process-wide ``MoEAuxLossAutoScaler`` scale (else it scales any later aux-loss backward)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    before = MoEAuxLossAutoScaler.main_loss_backward_scale
    saved = before.detach().clone() if torch.is_tensor(before) else None
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def train(
    config: RunConfig | None, out_dir: str | os.PathLike, *, resume: bool = False, extend: bool = False,
    stop_after: int | None = None, progress: bool | None = None,
) -> dict[str, Any]:
    """Train one run (every rank calls this under torchrun; a single process works without it).

    Args:
        config: None with ``resume`` (the run's own); else non-model changes only (:func:`start_state`).
        out_dir: run directory (new or empty for a fresh run).
        resume: continue from the newest checkpoint (or step 0); a finished run is left as it is.
        extend: with ``resume``, continue a finished run to a larger ``schedule.steps``.
        stop_after: stop after this many steps as if killed (no final checkpoint, no summary).
        progress: tqdm bar on rank 0 (default: when stderr is a terminal).

    Returns:
        The summary (``"finished_before": True`` if already done); with ``stop_after``, ``{experiment, stopped_at}``.

    Raises:
        ReproError: bad config or run directory, corrupt checkpoint, layout change, non-finite loss, or
            :class:`~repro.training.preemption.RunStopped` after a stop signal.
    """
    from repro.model import parallel as model_parallel

    # Rank variables first: the lock is rank 0's, and a refused launch must leave nothing behind.
    if not model_parallel.is_initialized():
        os.environ.update(model_parallel.rank_environment(os.environ))
    paths = RunPaths(Path(out_dir))
    if config is not None and config.logging.tensorboard:  # before the run directory exists (a resume: below)
        from repro.training.tensorboard import check_tensorboard

        check_tensorboard(paths.root, config.logging.tensorboard_dir)
    with run_lock(paths):
        config, checkpoint, finished = start_state(paths, config, resume, extend)
        if finished is not None:
            return {**finished, "finished_before": True}
        owns_dist = not model_parallel.is_initialized()
        try:
            info = model_parallel.init_distributed(tp=config.parallel.tp, ep=config.parallel.ep, seed=config.seed)
        except ValueError as exc:
            raise ReproError(f"experiment '{config.name}': {exc}") from None
        try:
            with aux_loss_scale_restored():
                return _run(config, paths, checkpoint, info.device, stop_after, progress)
        finally:
            if owns_dist:
                model_parallel.destroy_distributed()


def _run(config, paths, checkpoint, device, stop_after, progress) -> dict[str, Any]:
    start = time.perf_counter()
    trainer = Trainer(config, paths, checkpoint, device, progress)
    non_finite = None
    try:
        finished = trainer.fit(stop_after)
    except NonFiniteLoss as exc:
        non_finite = str(exc)  # the message only: the exception's traceback holds the step's frames, the model
    finally:
        trainer.close()  # the model goes with this function's frame
    # The errors below keep this frame in their tracebacks: drop the trainer (model, optimizer state) first.
    if non_finite is not None:
        del trainer
        latest = ckpt.find_latest_checkpoint(paths.checkpoints)
        where = f"its checkpoint of step {ckpt.read_checkpoint_info(latest).step}" if latest else "step 0"
        raise ReproError(
            f"{non_finite}; the run stopped and its log and checkpoints are kept in {paths.root}: resume from {where} "
            f"with other settings, e.g. python -m repro train --out {paths.root} --resume --set optimizer.lr=..."
        )
    if trainer.stopped_by:
        from repro.training.preemption import RunStopped

        step, stopped_by = trainer.step, trainer.stopped_by
        del trainer
        raise RunStopped(f"experiment '{config.name}': stopped by {stopped_by} after step {step} "
                         f"(checkpointed); resume with --resume", step, stopped_by)
    if not finished:
        return {"experiment": config.name, "stopped_at": trainer.step}
    barrier()
    rows = read_rows(paths.log) if paths.log.exists() else []
    record = trainer.config_record
    summary = summarize(rows, config, {
        **{key: record[key] for key in ("layout", "device", "precision", "seq_length")},
        "global_batch_size": config.data.global_batch_size, "parameters": record["parameters"],
        "wall_time_s_last_segment": time.perf_counter() - start,
    })
    if trainer.parallel.is_main:
        write_json_atomic(paths.summary, summary)
    return summary

