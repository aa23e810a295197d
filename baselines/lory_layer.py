"""Lory's parameter-merging MoE layer (Zhong et al. 2024), in place of megatron's dispatch for ``lory``.

No token is sent to an expert: per segment of ``segment_length`` tokens the experts' FFN *parameters* are merged
with the segment's routing weights and the merged SwiGLU FFN runs on the segment's tokens:

    W1(g, b) = sum_e w_e(g, b) W1_e      W2(g, b) = sum_e w_e(g, b) W2_e
    y = W2(g, b) (silu(W1_gate(g, b) x) * W1_up(g, b) x)      for x in segment g of sequence b

The router gives every token of a segment its segment's weights in ``probs [T, E]``; the layer reads one vector
per (segment, sequence) (their mean, checked equal). Merging parameters is NOT mixing outputs; exact are: the
first projection's pre-activations are the weighted sums of the experts', and a one-hot weight gives that expert.

Inference routes once on the prompt (the paper): inside ``routers.megatron_adapter.prompt_routing`` each sequence
is routed, for all its tokens, on the mean hidden state of its first ``prompt_length`` tokens (a one-token segment
0); the lm-eval bridge passes the context length.

The dense start (:attr:`~baselines.lory.LoryRouter.dense_phase`): one dense SwiGLU FFN, no router call. The
experts, built as copies of expert 0, are tied: the forward uses ``W_0 + sum_e (W_e - stopgrad(W_e)) / sqrt(E)``
(exactly W_0), so each expert gets the dense gradient / sqrt(E): together the dense gradient norm (clipping acts
as on the dense model), and AdamW is scale-free (up to eps). They stay bit-identical.

Memory: every (segment, sequence)'s merged weights are kept for the backward (``G * B * 3 * F * H`` per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer


def lory_merged_ffn(
    x_BLH: torch.Tensor, weights_BE: torch.Tensor, fc1_EGH: torch.Tensor, fc2_EHF: torch.Tensor
) -> torch.Tensor:
    """``[B, L, H]``: per sequence b, the SwiGLU FFN with ``weights_BE[b]``-weighted parameters on ``x_BLH[b]``.
    ``fc1_EGH`` ``[E, 2F, H]``: gate rows then up rows (megatron's ``gated_linear_unit`` layout; G = 2F)."""
    w_BE = weights_BE.to(fc1_EGH.dtype)
    fc1_BGH = torch.einsum("be,egh->bgh", w_BE, fc1_EGH)
    fc2_BHF = torch.einsum("be,ehf->bhf", w_BE, fc2_EHF)
    pre_BLG = torch.bmm(x_BLH, fc1_BGH.transpose(1, 2))
    gate_BLF, up_BLF = torch.chunk(pre_BLG, 2, dim=-1)
    return torch.bmm(F.silu(gate_BLF) * up_BLF, fc2_BHF.transpose(1, 2))


class LoryMoELayer(MoELayer):
    """megatron's MoELayer with the dispatch replaced by Lory's per-segment parameter merge (built from an MoE
    layer's spec; megatron's token dispatcher is never used)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None) -> None:
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        if self.num_local_experts != config.num_moe_experts:
            raise ValueError("Lory merges all experts' parameters: expert parallel size must be 1")
        if not isinstance(self.experts, SequentialMLP):
            raise ValueError(f"Lory needs SequentialMLP experts (local spec), got {type(self.experts).__name__}")
        if self.experts.tp_group is not None and self.experts.tp_group.size() != 1:
            raise ValueError("Lory needs expert tensor parallel size 1")
        if not config.gated_linear_unit or config.activation_func is not F.silu or config.add_bias_linear:
            raise ValueError("Lory's merge is implemented for bias-free SwiGLU experts")
        if self.lory_router.config.dense_steps > 0:
            with torch.no_grad():  # the dense start trains tied copies of one FFN: they start equal
                first = self.experts.local_experts[0]
                for expert in self.experts.local_experts[1:]:
                    expert.linear_fc1.weight.copy_(first.linear_fc1.weight)
                    expert.linear_fc2.weight.copy_(first.linear_fc2.weight)
        # Per-sequence prompt lengths, set only inside prompt_routing (never outlives that block).
        self._prompt_lengths_B: torch.Tensor | None = None

    @property
    def lory_router(self):
        """The :class:`~baselines.lory.LoryRouter` (megatron's adapter holds it as ``router``)."""
        return self.router.router

    @property
    def segment_length(self) -> int:
        return self.lory_router.config.segment_len

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fc1 [E, 2F, H], fc2 [E, H, F])``: the experts' parameters stacked (differentiable)."""
        experts = self.experts.local_experts
        fc1_EGH = torch.stack([e.linear_fc1.weight for e in experts])
        fc2_EHF = torch.stack([e.linear_fc2.weight for e in experts])
        return fc1_EGH, fc2_EHF

    def set_prompt_lengths(self, prompt_lengths_B: torch.Tensor | None) -> None:
        """Set (or clear) prompt lengths; use :func:`routers.megatron_adapter.prompt_routing` instead."""
        self._prompt_lengths_B = prompt_lengths_B

    def _segment_weights(self, probs_TE: torch.Tensor, S: int, B: int) -> torch.Tensor:
        """``[G, B, E]`` one weight vector per segment and sequence, read from the router's ``probs``."""
        L = self.segment_length
        E = probs_TE.shape[-1]
        probs_SBE = probs_TE.reshape(S, B, E)
        weights_GBE = torch.stack([probs_SBE[start : start + L].mean(0) for start in range(0, S, L)])
        # Router and layer disagreeing on the segment length: checked (a host sync) only on forwards collecting
        # metrics (the lengths are fixed settings; other steps must not sync).
        if not self.lory_router.collect_metrics:
            return weights_GBE
        spread = (probs_SBE.detach() - weights_GBE.detach().repeat_interleave(L, dim=0)[:S]).abs().max()
        if float(spread) > 1e-5:
            raise RuntimeError(
                f"Lory layer {self.layer_number}: probs vary within a segment of {L} tokens "
                f"(max deviation {float(spread):.3g}); router and layer disagree on the segment length"
            )
        return weights_GBE

    def _prompt_weights(self, hidden_SBH: torch.Tensor) -> torch.Tensor:
        """``[B, E]`` per-sequence weights routed once on the mean of the prompt's hidden states."""
        S, B, _ = hidden_SBH.shape
        lengths_B = self._prompt_lengths_B.to(hidden_SBH.device).clamp(1, S)
        positions_S = torch.arange(S, device=hidden_SBH.device)
        mask_SB = (positions_S[:, None] < lengths_B[None, :]).to(hidden_SBH.dtype)
        mean_BH = (hidden_SBH * mask_SB[..., None]).sum(0) / lengths_B[:, None].to(hidden_SBH.dtype)
        # The router sees each prompt mean as a one-token segment 0, which it routes on itself.
        probs_TE, _ = self.router(mean_BH[None], None)
        return probs_TE.reshape(B, -1)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        """Merge-and-run per segment of ``[S, B, H]`` hidden states: ``(output [S, B, H], None)``, as megatron's
        MoELayer; ``intermediate_tensors`` (partial CUDA graphs) and ``padding_mask`` must be None."""
        if intermediate_tensors is not None or padding_mask is not None:
            raise NotImplementedError("LoryMoELayer supports neither intermediate_tensors nor padding_mask")
        S, B, H = hidden_states.shape
        fc1_EGH, fc2_EHF = self.expert_weights()
        if self.lory_router.dense_phase:
            # The dense FFN: W_0 to the bit (W_e - stopgrad(W_e) is exactly 0), dense gradient / sqrt(E) to each W_e.
            scale = fc1_EGH.shape[0] ** -0.5
            fc1_GH = fc1_EGH[0].detach() + ((fc1_EGH - fc1_EGH.detach()) * scale).sum(0)
            fc2_HF = fc2_EHF[0].detach() + ((fc2_EHF - fc2_EHF.detach()) * scale).sum(0)
            x_1TH = hidden_states.reshape(1, S * B, H)
            one_11 = torch.ones(1, 1, dtype=fc1_GH.dtype, device=fc1_GH.device)
            y_1TH = lory_merged_ffn(x_1TH, one_11, fc1_GH[None], fc2_HF[None])
            return y_1TH.reshape(S, B, H).to(hidden_states.dtype), None
        L = self.segment_length
        if self._prompt_lengths_B is not None:
            if self._prompt_lengths_B.shape != (B,):
                raise RuntimeError(f"prompt lengths {tuple(self._prompt_lengths_B.shape)} do not match batch {B}")
            weights_BE = self._prompt_weights(hidden_states)
            weights_GBE = weights_BE[None].expand(-(-S // L), B, -1)
        else:
            probs_TE, _ = self.router(hidden_states, None)
            weights_GBE = self._segment_weights(probs_TE, S, B)

        x_BSH = hidden_states.transpose(0, 1)
        outputs = [lory_merged_ffn(x_BSH[:, start : start + L], weights_GBE[g], fc1_EGH, fc2_EHF)
                   for g, start in enumerate(range(0, S, L))]
        output_SBH = torch.cat(outputs, dim=1).transpose(0, 1).contiguous().to(hidden_states.dtype)
        return output_SBH, None
