"""The GPT model's output layer and cross-entropy in one op (``model.fused_cross_entropy``), without the
[tokens, vocab] logits megatron materialises (and, in its native fused cross-entropy, copies to fp32; its share of
a step's device time is in the H100 records, results/h100/findings.md).

Implementations (:data:`FUSED_CROSS_ENTROPY`):

- ``none``: megatron's output layer and ``compute_language_model_loss`` (a plain ``GPTModel``).
- ``cce``: cut-cross-entropy's Triton kernels (``pip install .[fused]``, GPU only), exact (``filter_eps=None``).
- ``cce_filtered``: with its default gradient filter (``filter_eps="high"``); faster, approximate.
- ``torch_compile``: matmul + fp32 CE by inductor, CCE's ``torch_compile`` reproduced (the package needs Triton).

Only the loss path changes; TP is refused (vocabulary-sharded weight). Every target is scored (the trainer
masks per-token losses), which also skips CCE's ``nonzero()`` host sync.
"""

from __future__ import annotations

import typing

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_model import GPTModel

#: ``model.fused_cross_entropy``'s values (``none``: megatron's own path).
FUSED_CROSS_ENTROPY: tuple[str, ...] = ("none", "cce", "cce_filtered", "torch_compile")


@torch.compile(fullgraph=True, dynamic=True)
def _compiled_linear_cross_entropy(e_NH: torch.Tensor, c_VH: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    # cut_cross_entropy.torch_compile.torch_compile_linear_cross_entropy_apply without softcap and ignore_index.
    logits_NV = e_NH @ c_VH.T
    return F.cross_entropy(logits_NV.float(), targets_N, reduction="none")


def _cce(e_NH: torch.Tensor, c_VH: torch.Tensor, targets_N: torch.Tensor, filter_eps: str | None) -> torch.Tensor:
    """cut-cross-entropy's autograd function on every target (``valids=None``, skipping its ``nonzero()``)."""
    try:
        from cut_cross_entropy.cce import CCEParams, linear_cross_entropy_apply
        from cut_cross_entropy.utils import _handle_eps
    except ImportError as exc:
        raise RuntimeError(
            f"model.fused_cross_entropy=cce needs cut-cross-entropy==25.1.1 and Triton ({exc}); install the "
            "'fused' extra on a GPU machine, or use fused_cross_entropy=torch_compile"
        ) from None
    params = CCEParams(targets=targets_N, valids=None, softcap=None, reduction="none",
                       filter_eps=_handle_eps(filter_eps, e_NH.dtype), shift=False, batch_shape=targets_N.shape)
    return linear_cross_entropy_apply(e_NH, c_VH, params)


def fused_linear_cross_entropy(hidden_SBH: torch.Tensor, weight_VH: torch.Tensor, labels_BS: torch.Tensor,
                               impl: str) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T`` against ``labels``, without materialising the fp32 logits.

    Args:
        hidden_SBH: the final norm's output.
        weight_VH: output-layer weight, whole padded vocabulary (padding rows scored, as megatron does).
        labels_BS: target ids.
        impl: one of :data:`FUSED_CROSS_ENTROPY` except ``none``.

    Returns:
        fp32 per-token losses [B, S] (as ``compute_language_model_loss``).
    """
    S, B, H = hidden_SBH.shape
    if labels_BS.shape != (B, S):
        raise ValueError(f"labels of shape {tuple(labels_BS.shape)} for hidden states [S={S}, B={B}, H={H}]")
    # Flatten sequence-first (the big tensor stays as it is); only the int labels are transposed.
    e_NH = hidden_SBH.reshape(S * B, H).contiguous()
    targets_N = labels_BS.transpose(0, 1).reshape(S * B).contiguous()
    if impl == "torch_compile":
        loss_N = _compiled_linear_cross_entropy(e_NH, weight_VH, targets_N)
    elif impl in ("cce", "cce_filtered"):
        loss_N = _cce(e_NH, weight_VH, targets_N, filter_eps=None if impl == "cce" else "high")
    else:
        raise ValueError(f"fused_linear_cross_entropy needs a fused implementation, got '{impl}'")
    return loss_N.float().view(S, B).transpose(0, 1).contiguous()


class FusedLossGPTModel(GPTModel):
    """``GPTModel`` whose loss with labels is :func:`fused_linear_cross_entropy`; everything else (logits, MTP,
    inference), parameters and state dict are ``GPTModel``'s.

    Args:
        fused_cross_entropy: one of :data:`FUSED_CROSS_ENTROPY` except ``none``.
        *args, **kwargs: ``GPTModel``'s.
    """

    def __init__(self, *args: typing.Any, fused_cross_entropy: str, **kwargs: typing.Any) -> None:
        if fused_cross_entropy not in FUSED_CROSS_ENTROPY[1:]:  # "none" is a plain GPTModel
            raise ValueError(f"unknown fused_cross_entropy '{fused_cross_entropy}' for FusedLossGPTModel; valid: "
                             f"{', '.join(FUSED_CROSS_ENTROPY[1:])}")
        super().__init__(*args, **kwargs)
        if self.config.tensor_model_parallel_size > 1:
            raise ValueError(f"fused_cross_entropy='{fused_cross_entropy}' needs tensor-parallel size 1, "
                             f"got {self.config.tensor_model_parallel_size}")
        self.fused_cross_entropy = fused_cross_entropy

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        # megatron 0.16.1 passes everything by keyword; the fused path only replaces "output layer, then loss".
        plain = (labels is None or args or not self.post_process or self.config.mtp_num_layers is not None
                 or kwargs.get("mtp_in_postprocess") or kwargs.get("inference_context") is not None
                 or self.output_layer.bias is not None)
        if plain:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        weight_VH = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                     else self.output_layer.weight)
        return fused_linear_cross_entropy(hidden_states, weight_VH, labels, self.fused_cross_entropy)
