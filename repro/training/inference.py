"""Trained checkpoints as scoring models: what the lm-eval bridge and the routing analysis load."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from repro.config import RunConfig
from repro.errors import ReproError
from repro.training import checkpoint as ckpt


class CheckpointScorer(nn.Module):
    """A loaded GPTModel behind the bridge's ``ScoringModel`` protocol; ``vocab_size`` is the tokenizer's (padded
    logits cut off), ``max_length`` the training sequence length."""

    def __init__(
        self, model: nn.Module, config: RunConfig, eod_id: int, vocab_size: int, max_length: int, device: torch.device
    ):
        super().__init__()
        self.model, self.config, self.device = model, config, device
        self.eod_id, self.vocab_size, self.max_length = int(eod_id), int(vocab_size), int(max_length)

    @property
    def batch_coupled(self) -> bool:
        """Whether routing depends on the batch (Expert Choice, capacity): then score one request at a time."""
        from routers import RoutingKind, routers_in

        kinds = {r.constraint.kind for r in routers_in(self.model)}
        return bool(kinds & {RoutingKind.EXPERT_CHOICE, RoutingKind.CAPACITY})

    @torch.no_grad()
    def logits(
        self, tokens_BS: torch.Tensor, prompt_lengths_B: list[int] | None = None, start: int = 0
    ) -> torch.Tensor:
        """Float32 next-token logits ``[B, S - start, V]`` (tokenizer vocabulary) of positions ``start..S-1``.

        Args:
            tokens_BS: token ids.
            prompt_lengths_B: context tokens per row (Lory's layers then route each row on its prompt alone).
            start: first position scored; only the output layer skips earlier positions.
        """
        from repro.model.cpu_shims import causal_attention_mask
        from routers.megatron_adapter import prompt_routing, token_ids_context

        tokens_BS = tokens_BS.to(self.device)
        B, S = tokens_BS.shape
        mask = causal_attention_mask(S, self.device)
        position_ids_BS = torch.arange(S, device=self.device).unsqueeze(0).expand(B, S)
        prompt = prompt_routing(self.model, prompt_lengths_B) if prompt_lengths_B is not None else contextlib.nullcontext()
        # The output layer's input is megatron's [S, B, H]: keep the positions from ``start``.
        keep = self.model.output_layer.register_forward_pre_hook(lambda _, args: (args[0][start:], *args[1:]))
        try:
            with token_ids_context(self.model, tokens_BS), prompt:
                logits_BSV = self.model(tokens_BS, position_ids_BS, mask)
        finally:
            keep.remove()
        return logits_BSV[..., : self.vocab_size].float()

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.logits(tokens_BS)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory from a checkpoint, a run's ``checkpoints`` directory or a run directory (ReproError:
    nothing to load; a run killed during its first checkpoint is told apart)."""
    path = Path(path)
    resolved = ckpt.resolve_checkpoint(path)
    if (resolved / "meta.json").is_file():
        return resolved
    for candidate in (path, path / "checkpoints"):
        if incomplete := ckpt.incomplete_checkpoints(candidate):
            raise ReproError(
                f"{path}: no complete checkpoint yet (the run was stopped while writing {incomplete[-1].name}); "
                "nothing to load"
            )
    raise ReproError(f"{path}: no checkpoint found (expected a run directory or checkpoints/step_*)")


def run_dir_of(checkpoint_dir: Path) -> Path:
    return checkpoint_dir.parent.parent


def _run_tokenizer_dir(checkpoint_dir: Path, config: RunConfig) -> str:
    """The run's tokenizer as ``config.json`` records it (ReproError: gone or changed); else the data sources'."""
    from repro.training.data import data_sources, tokenizer_fingerprint

    config_path = run_dir_of(checkpoint_dir) / "config.json"
    recorded = None
    if config_path.is_file():
        try:
            recorded = json.loads(config_path.read_text()).get("tokenizer")
        except (ValueError, AttributeError):
            raise ReproError(f"{config_path}: not a run's config.json") from None
    if not recorded:
        return data_sources(config)[1]
    tokenizer_dir = recorded["dir"]
    try:
        found = tokenizer_fingerprint(tokenizer_dir)
    except OSError:
        raise ReproError(f"{tokenizer_dir}: the run's tokenizer (recorded in {config_path}) is missing") from None
    if found != recorded["sha256"]:
        raise ReproError(
            f"{tokenizer_dir}: the tokenizer files changed since the run trained (recorded in {config_path}); "
            "evaluating with another vocabulary would be meaningless"
        )
    return tokenizer_dir


def load_for_evaluation(path: str | os.PathLike, device: str | None = None) -> tuple[CheckpointScorer, Any]:
    """Rebuild a run's model in one process from its checkpoint (any DP/EP layout) for scoring.

    Args:
        path: run directory (newest checkpoint), ``checkpoints`` directory or one checkpoint.
        device: ``"cpu"``/``"cuda"``; default CUDA when available.

    Returns:
        ``(CheckpointScorer in eval mode, tokenizer)``; routers skip their diagnostic metrics.

    Raises:
        ReproError: no checkpoint, a synthetic-data run (no tokenizer), or weights that do not fit.
    """
    from repro.model import parallel as model_parallel
    from repro.model.builder import build_model
    from repro.model.cpu_shims import apply_cpu_shims
    from repro.training.data import load_run_tokenizer
    from repro.training.distributed import current_parallel
    from routers import routers_in

    checkpoint_dir = resolve_checkpoint(path)
    info = ckpt.read_checkpoint_info(checkpoint_dir)
    config = RunConfig.from_dict(info.experiment, origin=str(checkpoint_dir / "meta.json"))
    tokenizer = load_run_tokenizer(_run_tokenizer_dir(checkpoint_dir, config))

    apply_cpu_shims()
    if not model_parallel.is_initialized():
        model_parallel.init_distributed(tp=1, ep=1, seed=config.seed)
    seq_length = config.seq_length
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        model = build_model(**config.model_kwargs(), vocab_size=tokenizer.vocab_size, seq_length=seq_length)
    except (ValueError, TypeError) as exc:
        raise ReproError(f"{checkpoint_dir}: cannot rebuild the model: {exc}") from None
    ckpt.load_model_weights(checkpoint_dir, model, current_parallel())
    model.to(target).eval()
    for router in routers_in(model):
        router.collect_metrics = False  # scoring reads the routing alone, not the training log's diagnostics
    return CheckpointScorer(model, config, tokenizer.eod, tokenizer.vocab_size, seq_length, target).eval(), tokenizer
