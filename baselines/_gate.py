"""The linear gate the learned baselines share (Switch, ReMoE, Expert Choice, Lory, SparseMixer-v2).

Shape legend: T tokens, D hidden size, E experts (see :mod:`routers.base`).
"""

from __future__ import annotations

import torch
from torch import nn


def make_gate_weight(num_experts: int, hidden_size: int, init_std: float) -> nn.Parameter:
    """A bias-free gate weight ``[E, D]`` in float32, drawn from N(0, init_std^2).

    The layout ``[E, D]`` is megatron-core's ``Router.weight``, so a state dict (or a test) can copy
    weights between this gate and megatron-core's TopKRouter unchanged. The default std of the
    baselines is 0.01, the reproduction models' ``init_method_std`` (ReMoE's scripts).

    Args:
        num_experts: E.
        hidden_size: D.
        init_std: standard deviation of the normal initialisation (mean 0).

    Returns:
        The parameter.
    """
    weight_ED = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
    nn.init.normal_(weight_ED, mean=0.0, std=init_std)
    return weight_ED


def gate_logits(hidden_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """Router logits ``hidden @ weight^T`` computed in float32.

    Both operands are cast to float32 and autocast is switched off around the product, so the
    router maths stays in float32 under bf16 training (megatron-core's ``moe_router_dtype='fp32'``
    computes the same ``torch.mm(inp.float(), weight.float().t())``).

    Args:
        hidden_TD: ``[T, D]`` hidden states, any floating dtype.
        weight_ED: ``[E, D]`` gate weight.

    Returns:
        ``[T, E]`` float32 logits.
    """
    with torch.autocast(device_type=hidden_TD.device.type, enabled=False):
        return torch.mm(hidden_TD.float(), weight_ED.float().t())


def check_init_std(init_std: float) -> None:
    """``ValueError`` unless ``init_std`` > 0 (shared by the configs' ``__post_init__``)."""
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
