"""Model flavours: frozen configs of the LLaMA-style GPT models the suite trains: ``tiny`` (the CPU model that
trains in seconds), ``185m`` (LLaMA-185M, the published setting of ReMoE and DirMoE: RMSNorm, RoPE base 1e6, untied
embeddings, no biases, init std 0.01, no dropout, GPT-2 BPE vocabulary), and their ``-dense`` twins with one
SwiGLU FFN of the expert's width instead of the MoE layer (the dense baseline at the compute of k=1).
A flavour's name is also its experiments' suffix (``dirmoe-185m``) and its recipe's key (``repro.experiments``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from repro.schema import check_minimums

#: Megatron-LM pads the vocabulary to a multiple of this (times the tensor-parallel size).
VOCAB_PAD_MULTIPLE = 128
#: megatron-core's own TopKRouter, offered by the model builder under this name (a reference for Switch).
MEGATRON_ROUTER = "megatron"
#: Options of the ``megatron`` router -> the megatron-core TransformerConfig field each sets.
MEGATRON_ROUTER_OPTIONS: dict[str, str] = {
    "aux_loss_coeff": "moe_aux_loss_coeff",
    "z_loss_coeff": "moe_z_loss_coeff",
    "capacity_factor": "moe_expert_capacity_factor",
}


def refuse_unknown(given: Iterable[str], valid: Iterable[str], what: str, where: str = "") -> None:
    """ValueError ``unknown <what>(s) <names><where>; valid: <names>`` for names of ``given`` not in ``valid``."""
    valid = sorted(valid)
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(unknown)}{where}; valid: {', '.join(valid)}")


@dataclass(frozen=True)
class ModelFlavour:
    """One model's architecture: ``num_query_groups`` GQA heads, ``ffn_hidden_size`` one expert's (or the dense)
    SwiGLU width, ``num_experts`` E (None: dense), ``top_k`` nominal, ``seq_length`` also RoPE's max position,
    ``vocab_size`` before padding (None: at build time), ``token_dispatcher`` ``"alltoall"``/``"allgather"``."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    num_experts: int | None
    top_k: int = 1
    seq_length: int = 1024
    vocab_size: int | None = None
    rotary_base: int = 1_000_000
    init_method_std: float = 0.01
    layernorm_epsilon: float = 1e-5
    token_dispatcher: str = "alltoall"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"{self.name}: hidden {self.hidden_size} not divisible by {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"{self.name}: {self.num_attention_heads} heads not divisible by "
                             f"{self.num_query_groups} query groups")
        check_minimums(self, self.name, num_experts=2, vocab_size=1)  # None: dense; the tokenizer's vocabulary
        if self.num_experts is not None and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"{self.name}: top_k must be in [1, {self.num_experts}], got {self.top_k}")
        if self.token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(f"{self.name}: token_dispatcher must be 'alltoall' or 'allgather'")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def kv_channels(self) -> int:  # d_head = h / a
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, vocab_size: int | None = None, tp: int = 1) -> int:
        """Embedding/output size V: ``vocab_size`` (default this flavour's) padded to ``128 * tp`` (Megatron-LM)."""
        size = vocab_size if vocab_size is not None else self.vocab_size
        if size is None:
            raise ValueError(f"flavour '{self.name}' has no vocab_size; pass the tokenizer's size")
        multiple = VOCAB_PAD_MULTIPLE * tp
        return -(-size // multiple) * multiple

    def dense(self) -> ModelFlavour:
        """The dense counterpart (same model, one SwiGLU FFN of the same width per block)."""
        if not self.is_moe:
            return self
        return dataclasses.replace(self, name=f"{self.name}-dense", num_experts=None)


_TINY = ModelFlavour(
    name="tiny", num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
    num_experts=8, top_k=1, seq_length=128, vocab_size=None,  # from the locally trained tokenizer
)
_LLAMA_185M = ModelFlavour(
    name="185m", num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=4,
    ffn_hidden_size=3072, num_experts=8, top_k=1, seq_length=1024,
    vocab_size=50257,  # GPT-2 BPE (padded to 50304 in the model)
)

_FLAVOURS: dict[str, ModelFlavour] = {f.name: f for f in (_TINY, _TINY.dense(), _LLAMA_185M, _LLAMA_185M.dense())}


#: Legacy names -> current flavour, so runs and records written under an old name still load.
RENAMED: dict[str, str] = {"llama-185m": "185m", "llama-185m-dense": "185m-dense"}


def available_flavours() -> list[str]:
    return sorted(_FLAVOURS)


def get_flavour(name: str | ModelFlavour, **overrides) -> ModelFlavour:
    """A flavour by name (or passed through), fields optionally overridden (ValueError naming valid ones)."""
    if isinstance(name, ModelFlavour):
        flavour = name
    else:
        try:
            flavour = _FLAVOURS[RENAMED.get(name, name)]
        except KeyError:
            raise ValueError(f"unknown model flavour '{name}'; available: {', '.join(available_flavours())}") from None
    refuse_unknown(overrides, [f.name for f in dataclasses.fields(flavour)], "flavour field")
    return dataclasses.replace(flavour, **overrides) if overrides else flavour
