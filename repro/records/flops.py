"""Model FLOPs per iteration as Megatron-LM counts them, so TFLOP/s are comparable with the papers.

Megatron-LM (``transformer_flops`` in ``megatron/training/training.py``) counts, per iteration, for a GQA
transformer with routed experts::

    12 * B * s * L * h^2 * [ (1 + g/a + s/(2h)) * (a*d_head/h)   attention: QKV/out projections, QK^T and AV
                             + (f/h) * k * (3/2 if SwiGLU else 1)  FFN of the k experts a token reaches
                             + V / (2*L*h) ]                       logits

B global batch (sequences), s sequence length, L layers, h hidden size, a heads, g query groups, d_head kv
channels, f FFN hidden size per expert, k experts per token, V padded vocabulary. 12 = 3 GEMM passes x 2
stacked GEMMs x 2 FLOPs per multiply-add. Router, norm, softmax and element-wise work are not counted.
Attention scores count the causal half of the square (``s/(2h)``; the DirMoE paper's TFLOP/s fit it,
docs/efficiency.md); ``attention="full"`` counts all of it (``s/h``) as ReMoE's fork does. "Analytic" uses the
nominal k, "measured" the mean k tokens reached (the FFN term is linear in k, so the layer mean is exact).
Dense: k = 1, f the dense FFN size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from repro.schema import check_minimums

#: How attention scores are counted: ``"causal"`` (half the s x s square) or ``"full"``.
ATTENTION_COUNTS = ("causal", "full")
DEFAULT_ATTENTION = "causal"
#: The count each choice names, for table captions and summaries (None: not recorded, i.e. the full square).
FORMULA_NAMES = {
    "causal": "current Megatron-LM's model-FLOPs count, causal attention halved: "
    "12BsLh^2[(1+g/a+s/2h)(a d/h) + (f/h) k 3/2 + V/(2Lh)]",
    "full": "Megatron-LM's model-FLOPs count with attention over the full s x s square (earlier Megatron-LM, "
    "ReMoE's fork): 12BsLh^2[(1+g/a+s/h)(a d/h) + (f/h) k 3/2 + V/(2Lh)]",
    None: "not recorded (records written before it was: the full s x s square)",
}


def formula_name(attention: str | None) -> str:
    """The FLOPs count a record's TFLOP/s come from (:data:`FORMULA_NAMES`)."""
    return FORMULA_NAMES[attention]


@dataclass(frozen=True)
class FlopsConfig:
    """The module docstring's L, h, a, g, d_head, f, V; nominal k (1 if dense); ``swiglu`` (three h x f matrices,
    not two); ``attention`` (:data:`ATTENTION_COUNTS`)."""

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
        check_minimums(self, num_layers=1, hidden_size=1, num_attention_heads=1, num_query_groups=1, kv_channels=1,
                       ffn_hidden_size=1, vocab_size=1, top_k=0)


def flops_config_from_flavour(flavour: Any, vocab_size: int | None = None, tp: int = 1,
                              attention: str = DEFAULT_ATTENTION) -> FlopsConfig:
    """The FLOPs dimensions of a model flavour.

    Args:
        flavour: a ``repro.flavours.ModelFlavour`` (read by attribute; ``num_experts`` None: dense).
        vocab_size: tokenizer size before padding (default: the flavour's).
        tp, attention: tensor-parallel size (the padding multiple grows with it); :data:`ATTENTION_COUNTS`.

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


def model_flops_per_iteration(cfg: FlopsConfig, global_batch_size: int, seq_length: int,
                              experts_per_token: float | Sequence[float]) -> float:
    """Megatron-LM's model FLOPs for one training iteration (forward and backward).

    Args:
        cfg: model dimensions.
        global_batch_size, seq_length: B (all ranks), s.
        experts_per_token: k, or one k per MoE layer (averaged).
    """
    B, s, L, h = global_batch_size, seq_length, cfg.num_layers, cfg.hidden_size
    a, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    gate = 1.5 if cfg.swiglu else 1.0
    # QK^T and AV over the s x s square, or its causal half.
    square = 0.5 if cfg.attention == "causal" else 1.0
    attention = (1 + g / a + square * s / h) * (a * d / h)
    ffn = (cfg.ffn_hidden_size / h) * _mean_k(experts_per_token) * gate
    logits = cfg.vocab_size / (2 * L * h)
    return 12.0 * B * s * L * h * h * (attention + ffn + logits)


def analytic_flops_per_iteration(cfg: FlopsConfig, global_batch_size: int, seq_length: int) -> float:
    """:func:`model_flops_per_iteration` at the nominal k (``cfg.top_k``): the figure the papers report."""
    return model_flops_per_iteration(cfg, global_batch_size, seq_length, cfg.top_k)


def expert_flops_per_token(cfg: FlopsConfig, experts_per_token: float | Sequence[float]) -> float:
    """Expert FLOPs per token over all layers, ``12 * L * h * f * k * (3/2 if SwiGLU)``: what parity compares."""
    gate = 1.5 if cfg.swiglu else 1.0
    return 12.0 * cfg.num_layers * cfg.hidden_size * cfg.ffn_hidden_size * _mean_k(experts_per_token) * gate


def tflops_per_device(flops_per_iteration: float, iteration_time_s: float, num_devices: int) -> float:
    """Achieved model TFLOP/s per device: ``flops_per_iteration / iteration_time_s / num_devices / 1e12``."""
    if iteration_time_s <= 0 or num_devices < 1:
        raise ValueError(f"need iteration_time_s > 0 and num_devices >= 1, got {iteration_time_s}, {num_devices}")
    return flops_per_iteration / iteration_time_s / num_devices / 1e12
