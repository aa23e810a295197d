"""The few patches megatron-core 0.16.1 needs to build and train on a machine without CUDA.

:func:`apply_cpu_shims` (called by ``build_model`` and ``init_distributed``) is idempotent and a no-op with
CUDA; each shim has a test in ``tests/test_cpu_shims.py`` that fails when megatron-core's behaviour changes
(measured on megatron-core 0.16.1, torch 2.13.0 CPU):

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")`` instead of raising: megatron-core asks it for
   the device of what it allocates itself (``DotProductAttention``'s matmul buffer, the rotary ``inv_freq``, ...).
2. The CUDA RNG tracker (``CudaRNGStatesTracker.add`` reads the CUDA generator's state): not a patch;
   :func:`seed_model_parallel_rng` seeds the *inference* tracker on CPU, whose ``fork()`` is a no-op, so
   dropout draws from torch's CPU generator. Our models have no dropout and TP is 1 on CPU: nothing is lost.
3. ``get_default_causal_mask`` (used when ``attention_mask`` is ``None``) allocates on ``device="cuda"``. Pass
   an explicit mask (:func:`causal_attention_mask`); the shim also rebinds the name inside
   ``megatron.core.fusions.fused_softmax`` to a CPU version, so a forgotten mask gives the same result.
4. ``moe_utils.te_general_gemm`` is imported only with TransformerEngine but read unconditionally in
   ``RouterGatingLinearFunction`` (a megatron bug: ``NameError`` without TE); the shim defines it as ``None``.
5. The alltoall token dispatcher creates a ``torch.cuda.Stream`` and copies the split sizes to the host on it
   (``_maybe_dtoh_and_synchronize``); the shim gives the class a placeholder stream and a stream-free method
   that makes the same conversions (split sizes to numpy) at the same point.
6. ``get_megatron_optimizer`` hard-codes ``device='cuda'``: NOT patched, the training loop uses
   ``torch.optim.AdamW`` on CPU (:mod:`repro.training.optim`).
7. Speed, not a failure: the vocab-parallel cross-entropy takes the logits' maximum with ``torch.max(x, dim)``,
   which also computes the indices it throws away; on CPU that is several times slower than ``amax``. The shim makes
   ``VocabParallelCrossEntropy.calculate_logits_max`` take ``amax``: the same values, bit for bit.
"""

from __future__ import annotations

import functools

import torch

# Marker set on patched objects so the shims are idempotent and tests can see what was applied.
_SHIM_MARK = "_repro_cpu_shim"


def cuda_available() -> bool:
    """Whether a CUDA device is usable (the shims are applied only when this is False)."""
    return torch.cuda.is_available()


def _cpu_current_device() -> torch.device:
    # Shim 1: megatron-core passes this to ``device=`` / ``.to(device=...)``; "cpu" keeps those working.
    return torch.device("cpu")


setattr(_cpu_current_device, _SHIM_MARK, True)


@functools.lru_cache(maxsize=8)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    # Shim 3: same mask as megatron's get_default_causal_mask (True above the diagonal = masked), on CPU.
    # Cached like the explicit masks: it is rebuilt for every layer and micro-batch otherwise. Never an inference
    # tensor, whatever mode the first call came from: training could not save it for backward.
    with torch.inference_mode(False):
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


setattr(_cpu_default_causal_mask, _SHIM_MARK, True)


def _cpu_maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
    """Stream-free ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` (shim 5): the splits become
    numpy at ``cuda_dtoh_point``, as on GPU, without the side stream and the event."""

    def as_numpy(value):
        return value.numpy() if torch.is_tensor(value) else value

    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = as_numpy(self.input_splits)
        self.output_splits = as_numpy(self.output_splits)
        self.output_splits_tp = as_numpy(self.output_splits_tp)
    return tokens_per_expert


setattr(_cpu_maybe_dtoh_and_synchronize, _SHIM_MARK, True)


def _amax_logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Shim 7: megatron's calculate_logits_max with amax (the maximum alone) in place of max(dim)'s values.
    vocab_parallel_logits = vocab_parallel_logits.float()
    return vocab_parallel_logits, vocab_parallel_logits.amax(dim=-1)


setattr(_amax_logits_max, _SHIM_MARK, True)


class _NoStream:
    """Placeholder for the alltoall dispatcher's class-level ``cuda_dtoh_stream`` (shim 5): its presence
    stops the constructor from creating a ``torch.cuda.Stream``; the stream-free method never uses it."""

    def __repr__(self) -> str:
        return "<no CUDA stream (CPU shim)>"


def apply_cpu_shims() -> bool:
    """Patch megatron-core (and ``torch.cuda.current_device``) so it runs without CUDA; idempotent.

    Returns:
        True if the shims are in place (CPU machine), False if CUDA is available and nothing was done.
    """
    if cuda_available():
        return False

    # 1. torch.cuda.current_device -> cpu
    if not getattr(torch.cuda.current_device, _SHIM_MARK, False):
        torch.cuda.current_device = _cpu_current_device

    # 3. default causal mask, rebound where megatron reads it (fused_softmax imported it by name).
    from megatron.core.fusions import fused_softmax

    if not getattr(fused_softmax.get_default_causal_mask, _SHIM_MARK, False):
        fused_softmax.get_default_causal_mask = _cpu_default_causal_mask

    # 4. te_general_gemm missing without TransformerEngine.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # 5. the alltoall dispatcher's CUDA stream.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not getattr(MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize, _SHIM_MARK, False):
        MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_maybe_dtoh_and_synchronize
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()

    # 7. the cross-entropy's logits maximum without indices.
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    if not getattr(VocabParallelCrossEntropy.calculate_logits_max, _SHIM_MARK, False):
        VocabParallelCrossEntropy.calculate_logits_max = staticmethod(_amax_logits_max)

    return True  # 2. and 6. are not patches (see the module docstring)


def shims_applied() -> bool:
    """Whether :func:`apply_cpu_shims` has patched this process (always False on a CUDA machine)."""
    if cuda_available():
        return False
    return bool(getattr(torch.cuda.current_device, _SHIM_MARK, False))


def seed_model_parallel_rng(seed: int) -> None:
    """Seed torch and megatron-core's model-parallel RNG tracker for this machine (shim 2; needs megatron's
    ``parallel_state``: the tracker derives the tensor- and expert-parallel seeds from ``seed``)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if cuda_available():
        model_parallel_cuda_manual_seed(seed)
    else:
        # The regular tracker snapshots CUDA generator states; the inference tracker's add/fork are no-ops.
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def causal_attention_mask(seq_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The explicit causal attention mask to pass to ``GPTModel.forward``: ``[1, 1, S, S]`` bool on ``device``,
    True where attention is NOT allowed (above the diagonal), megatron's convention."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)[None, None]
