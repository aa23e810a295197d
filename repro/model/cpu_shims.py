"""The few patches megatron-core 0.16.1 needs to build and train on a machine without CUDA.

:func:`apply_cpu_shims` (called by ``build_model``, ``init_distributed``) is idempotent, a no-op with CUDA;
``tests/test_cpu_shims.py`` fails when megatron-core's behaviour changes:

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")``: megatron allocates on it (matmul buffer, ...).
2. CUDA RNG tracker: not patched; :func:`seed_model_parallel_rng` seeds the *inference* tracker (no-op
   ``fork``: harmless without dropout, TP 1 on CPU).
3. ``get_default_causal_mask`` allocates on CUDA: pass :func:`causal_attention_mask`; also rebound to a CPU one.
4. ``RouterGatingLinearFunction`` reads ``moe_utils.te_general_gemm``, defined only with TE: set to ``None``.
5. The alltoall dispatcher's ``torch.cuda.Stream``: placeholder stream, stream-free ``_maybe_dtoh_and_synchronize``.
6. ``get_megatron_optimizer`` hard-codes CUDA: NOT patched; CPU uses torch's AdamW (:mod:`repro.training.optim`).
7. Speed only: CE's ``torch.max(x, dim)`` computes unused indices; ``amax`` instead (bit-identical).
"""

from __future__ import annotations

import functools

import torch


def cuda_available() -> bool:
    """Whether a CUDA device is usable (the shims are applied only when this is False)."""
    return torch.cuda.is_available()


def _cpu_current_device() -> torch.device:
    # Shim 1: megatron-core passes this to ``device=`` / ``.to(device=...)``; "cpu" keeps those working.
    return torch.device("cpu")


@functools.lru_cache(maxsize=8)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    # Shim 3, cached; never an inference tensor (whatever the first caller's mode): backward must save it.
    with torch.inference_mode(False):
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
    """Stream-free ``_maybe_dtoh_and_synchronize`` (shim 5): splits become numpy at ``cuda_dtoh_point``."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            setattr(self, name, value.numpy() if torch.is_tensor(value) else value)
    return tokens_per_expert


def _amax_logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Shim 7: megatron's calculate_logits_max with amax (the maximum alone) in place of max(dim)'s values.
    vocab_parallel_logits = vocab_parallel_logits.float()
    return vocab_parallel_logits, vocab_parallel_logits.amax(dim=-1)


def apply_cpu_shims() -> bool:
    """Patch megatron-core (and ``torch.cuda.current_device``) to run without CUDA; idempotent.

    Returns:
        True if the shims are in place, False with CUDA.
    """
    if cuda_available():
        return False

    # Plain assignments of fixed replacements (none wraps what it replaces): repeating them changes nothing.
    torch.cuda.current_device = _cpu_current_device  # shim 1

    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask  # shim 3 (fused_softmax imported it by name)

    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # shim 4
        moe_utils.te_general_gemm = None

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_maybe_dtoh_and_synchronize  # shim 5
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        # Placeholder: megatron makes a torch.cuda.Stream while this is None, read only by the method replaced above.
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()

    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(_amax_logits_max)  # shim 7

    return True  # 2. and 6. are not patches (see the module docstring)


def seed_model_parallel_rng(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (shim 2; needs ``parallel_state`` for TP/EP seeds)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if cuda_available():
        model_parallel_cuda_manual_seed(seed)
    else:
        # The regular tracker snapshots CUDA generator states; the inference tracker's add/fork are no-ops.
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def causal_attention_mask(seq_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Explicit causal mask for ``GPTModel.forward``: ``[1, 1, S, S]`` bool, True = masked (megatron's convention)."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)[None, None]
