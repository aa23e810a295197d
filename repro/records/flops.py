"""Model FLOPs per iteration as Megatron-LM counts them, so TFLOP/s are comparable with the papers.

Current Megatron-LM (``num_floating_point_operations`` in ``megatron/training/training.py``, its
``transformer_flops``) counts, per iteration, for a GQA transformer with routed experts::

    12 * B * s * L * h^2 * [ (1 + g/a + s/(2h)) * (a*d_head/h)   attention: QKV/out projections, QK^T and AV
                             + (f/h) * k * (3/2 if SwiGLU else 1)  FFN of the k experts a token reaches
                             + V / (2*L*h) ]                       logits

B global batch (sequences), s sequence length, L layers, h hidden size, a attention heads, g query groups
(GQA), d_head kv channels, f FFN hidden size per expert, k experts per token, V padded vocabulary. The 12 is
3 GEMM passes (forward, two backward) x 2 stacked GEMMs x 2 FLOPs per multiply-add; Megatron-LM writes the
FFN as ``6 * h * f * k * (3 if SwiGLU else 2)`` and the logits as ``6 * h * V`` per token, the same numbers.
The router's own GEMM, norms, softmax and element-wise work are not counted.

Attention scores (QK^T and AV) are counted for the causal half of the s x s square (``s/(2h)``, Megatron-LM's
"causal mask (only half of the mask is non-zero)"); earlier Megatron-LM, and ReMoE's fork of it, counted the
full square (``s/h``): ``attention="full"``. The DirMoE paper's TFLOP/s fit the causal count, the default
(docs/efficiency.md).

The "analytic" figure uses the nominal k. The "measured" figure uses the mean number of experts a token
actually reached (routers such as ReMoE, DirMoE or Expert Choice do not route exactly k per token): the FFN
term is linear in k and summed over layers, so the per-layer mean of the measured k gives the exact total.
A dense model is k = 1 with f the dense FFN size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: How attention scores are counted: ``"causal"`` (current Megatron-LM, half the s x s square) or ``"full"``.
ATTENTION_COUNTS = ("causal", "full")
DEFAULT_ATTENTION = "causal"
#: The count each choice names, for table captions and summaries.
FORMULA_NAMES = {
    "causal": "current Megatron-LM's model-FLOPs count, causal attention halved: "
    "12BsLh^2[(1+g/a+s/2h)(a d/h) + (f/h) k 3/2 + V/(2Lh)]",
    "full": "Megatron-LM's model-FLOPs count with attention over the full s x s square (earlier Megatron-LM, "
    "ReMoE's fork): 12BsLh^2[(1+g/a+s/h)(a d/h) + (f/h) k 3/2 + V/(2Lh)]",
}


def formula_name(attention: str | None) -> str:
    """The FLOPs count a record's TFLOP/s come from (None: a record written before the count was recorded,
    when the suite counted the full square)."""
    if attention is None:
        return "not recorded (records written before it was: the full s x s square)"
    return FORMULA_NAMES[attention]


@dataclass(frozen=True)
class FlopsConfig:
    """The model dimensions the FLOPs count needs: L, h, a, g (equal to a without GQA), d_head, f (the dense FFN
    for a dense model) and V of the module docstring; the nominal k (1 for a dense model); a gated FFN (three
    h x f matrices instead of two); and how attention scores are counted (:data:`ATTENTION_COUNTS`)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    top_k: float = 1
    swiglu: bool = True
    attention: str = DEFAULT_ATTENTION

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_COUNTS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_COUNTS)}, got '{self.attention}'")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                     "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def flops_config_from_flavour(
    flavour: Any, vocab_size: int | None = None, tp: int = 1, attention: str = DEFAULT_ATTENTION
) -> FlopsConfig:
    """The FLOPs dimensions of a model flavour (``repro.flavours.ModelFlavour``, read by attribute).

    Args:
        flavour: has ``num_layers``, ``hidden_size``, ``num_attention_heads``, ``num_query_groups``,
            ``kv_channels``, ``ffn_hidden_size``, ``num_experts`` (None: dense), ``top_k`` and
            ``padded_vocab_size(vocab_size, tp)``.
        vocab_size: the tokenizer's size before padding (default: the flavour's).
        tp: tensor-parallel size (the padding multiple grows with it).
        attention: how attention scores are counted (:data:`ATTENTION_COUNTS`).

    Returns:
        The :class:`FlopsConfig` (SwiGLU; k = 1 for a dense flavour).
    """
    return FlopsConfig(
        num_layers=flavour.num_layers, hidden_size=flavour.hidden_size, num_attention_heads=flavour.num_attention_heads,
        num_query_groups=flavour.num_query_groups, kv_channels=flavour.kv_channels,
        ffn_hidden_size=flavour.ffn_hidden_size, vocab_size=flavour.padded_vocab_size(vocab_size, tp),
        top_k=1 if flavour.num_experts is None else flavour.top_k, swiglu=True, attention=attention,
    )


def _mean_k(experts_per_token: float | Sequence[float]) -> float:
    if isinstance(experts_per_token, (int, float)):
        return float(experts_per_token)
    values = [float(v) for v in experts_per_token]
    if not values:
        raise ValueError("experts_per_token is an empty sequence")
    return sum(values) / len(values)


def model_flops_per_iteration(
    cfg: FlopsConfig, global_batch_size: int, seq_length: int, experts_per_token: float | Sequence[float]
) -> float:
    """Megatron-LM's model FLOPs for one training iteration (forward and backward).

    Args:
        cfg: model dimensions.
        global_batch_size: B, sequences per iteration over all data-parallel ranks.
        seq_length: s.
        experts_per_token: k, or one k per MoE layer (their mean is used: the FFN term is linear in k).
    """
    B, s, L, h = global_batch_size, seq_length, cfg.num_layers, cfg.hidden_size
    a, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    gate = 1.5 if cfg.swiglu else 1.0
    # Scores and AV: s x s per head; current Megatron-LM counts only the causal half of the square.
    square = 0.5 if cfg.attention == "causal" else 1.0
    attention = (1 + g / a + square * s / h) * (a * d / h)
    ffn = (cfg.ffn_hidden_size / h) * _mean_k(experts_per_token) * gate
    logits = cfg.vocab_size / (2 * L * h)
    return 12.0 * B * s * L * h * h * (attention + ffn + logits)


def analytic_flops_per_iteration(cfg: FlopsConfig, global_batch_size: int, seq_length: int) -> float:
    """:func:`model_flops_per_iteration` at the nominal k (``cfg.top_k``): the figure the papers report."""
    return model_flops_per_iteration(cfg, global_batch_size, seq_length, cfg.top_k)


def measured_flops_per_iteration(
    cfg: FlopsConfig, global_batch_size: int, seq_length: int, mean_active_experts: float | Sequence[float]
) -> float:
    """:func:`model_flops_per_iteration` at the mean number of experts per token actually reached (overall, or
    one value per MoE layer)."""
    return model_flops_per_iteration(cfg, global_batch_size, seq_length, mean_active_experts)


def expert_flops_per_token(cfg: FlopsConfig, experts_per_token: float | Sequence[float]) -> float:
    """The FFN (expert) part of the count, per token, over all layers, ``12 * L * h * f * k * (3/2 if SwiGLU)``:
    what compute parity compares (``experts_per_token``: k, or one k per MoE layer)."""
    gate = 1.5 if cfg.swiglu else 1.0
    return 12.0 * cfg.num_layers * cfg.hidden_size * cfg.ffn_hidden_size * _mean_k(experts_per_token) * gate


def tflops_per_device(flops_per_iteration: float, iteration_time_s: float, num_devices: int) -> float:
    """Achieved model TFLOP/s per device, of ``flops_per_iteration`` over all ``num_devices`` that shared an
    iteration of ``iteration_time_s`` wall time."""
    if iteration_time_s <= 0 or num_devices < 1:
        raise ValueError(f"need iteration_time_s > 0 and num_devices >= 1, got {iteration_time_s}, {num_devices}")
    return flops_per_iteration / iteration_time_s / num_devices / 1e12


#: LLaMA-185M of ReMoE and DirMoE (12 layers, hidden 768, GQA 12/4, SwiGLU 3072), E=8, k=1.
LLAMA_185M = FlopsConfig(
    num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=4, kv_channels=64,
    ffn_hidden_size=3072, vocab_size=50304, top_k=1, swiglu=True,
)
