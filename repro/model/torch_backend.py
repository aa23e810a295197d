"""The torch backend's megatron-core modules: :class:`TorchGroupedMLP` replaces ``SequentialMLP`` as the MoE
layer's ``experts``, :class:`TorchSDPAttention` replaces ``DotProductAttention`` as ``core_attention``, each
keeping the contract (constructor, forward, state-dict keys) of the module it replaces (docs/efficiency.md,
"Model backends", has the kernel facts and options 1-3).
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.utils import is_layer_window_attention

from repro.model.backends import TorchBackendOptions, grouped_linear, grouped_mm_unusable_reason, offsets

_EXTRA_STATE = "_extra_state"


class TorchGroupedMLP(MegatronModule):
    """MoE ``experts`` as one grouped GEMM per projection; stacked ``fc1_weight [E_local, 2F, H]`` (gate then up
    rows) and ``fc2_weight [E_local, H, F]``, saved under ``SequentialMLP``'s per-expert keys.

    Args:
        num_local_experts: experts on this rank (``E / ep``).
        submodules: unused (``SequentialMLP`` contract).
        pg_collection: process groups (only ``expt_tp`` is read); default: megatron's.

    Raises:
        ValueError: expert tensor parallelism > 1, biases, FP8/FP4, or megatron's latent MoE projection.
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, options=None) -> None:
        super().__init__(config=config)
        self.options = options or TorchBackendOptions()
        self.tp_group = (pg_collection or get_default_pg_collection()).expt_tp
        for refused, why in ((self.tp_group is not None and self.tp_group.size() != 1,
                              "need expert tensor parallel size 1"),
                             (config.add_bias_linear, "have no biases (add_bias_linear=False)"),
                             (config.fp8 or config.fp4, "do not run FP8/FP4 (use backend 'te')"),
                             (config.moe_latent_size is not None, "do not support moe_latent_size")):
            if refused:
                raise ValueError(f"the torch backend's grouped experts {why}")
        self.num_local_experts = num_local_experts
        E, H, F_ = num_local_experts, config.hidden_size, config.moe_ffn_hidden_size
        G = 2 * F_ if config.gated_linear_unit else F_
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        self.fc1_weight = torch.nn.Parameter(torch.empty(E, G, H, device=device, dtype=config.params_dtype))
        self.fc2_weight = torch.nn.Parameter(torch.empty(E, H, F_, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            self._initialize()
        # As megatron's linear layers: TP attributes (size 1), no DP all-reduce for EP-sharded experts.
        expert_parallel = config.expert_model_parallel_size > 1
        set_tensor_model_parallel_attributes(self.fc1_weight, True, 1, 2 if config.gated_linear_unit else 1)
        set_tensor_model_parallel_attributes(self.fc2_weight, True, 2, 1)
        for weight in (self.fc1_weight, self.fc2_weight):
            weight.allreduce = not expert_parallel

    def _initialize(self) -> None:
        """SequentialMLP's initialisation draw for draw (per expert fc1 then fc2; EP tracker or fp32 master)."""
        config = self.config
        with torch.no_grad():
            if config.use_cpu_initialization:
                for e in range(self.num_local_experts):
                    for weight, init in ((self.fc1_weight, config.init_method), (self.fc2_weight, config.output_layer_init_method)):
                        master = torch.empty(weight.shape[1:], dtype=torch.float)
                        init(master)
                        weight[e].copy_(master.to(config.params_dtype))
            else:
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    for e in range(self.num_local_experts):
                        config.init_method(self.fc1_weight[e])
                        config.output_layer_init_method(self.fc2_weight[e])

    def use_grouped_kernel(self, hidden_MH: torch.Tensor) -> bool:
        """Whether ``hidden_MH`` takes torch's grouped kernel (option 1); RuntimeError if forced and impossible."""
        mode = self.options.expert_gemm
        if mode == "loop":
            return False
        # fc2's input is the activation [M, F], of the hidden states' dtype and device.
        reason = (grouped_mm_unusable_reason(hidden_MH, self.fc1_weight)
                  or grouped_mm_unusable_reason(hidden_MH, self.fc2_weight, in_features=self.fc2_weight.shape[2]))
        if reason is None:
            return True
        if mode == "grouped_mm" and reason != "no tokens":
            raise RuntimeError(f"expert_gemm='grouped_mm', but torch's grouped kernel cannot run here: {reason}")
        return False

    def _activation(self, fc1_MG: torch.Tensor, probs_M: torch.Tensor) -> torch.Tensor:
        """``MLP.forward``'s activation times the probs (``per_token_scale``); fused with ``bias_activation_fusion``."""
        config = self.config
        if config.bias_activation_fusion and config.gated_linear_unit and config.activation_func is F.silu:
            if fc1_MG.shape[0] > 0:  # (no tokens: no compilation for an empty shape)
                # One kernel each way; the config refuses a clamp or offset here.
                return weighted_bias_swiglu_impl(fc1_MG, None, probs_M.unsqueeze(-1), config.activation_func_fp8_input_store)
        if config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(fc1_MG, 2, dim=-1)
            if (val := config.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            act_MF = config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
        else:
            act_MF = config.activation_func(fc1_MG)
        return (act_MF * probs_M.unsqueeze(-1)).to(act_MF.dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """As ``SequentialMLP``: ``[M, H]`` tokens, ``[E_local]`` counts, ``[M]`` probs -> ``([M, H], None)``."""
        hidden_MH, probs_M = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            # As SequentialMLP: scale the inputs instead (top-1 only), then unit probs.
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
            hidden_MH = (probs_M.unsqueeze(-1) * hidden_MH).to(hidden_MH.dtype)
            probs_M = torch.ones_like(probs_M)
        counts = [int(c) for c in tokens_per_expert.tolist()]
        if len(counts) != self.num_local_experts or sum(counts) != hidden_MH.shape[0]:
            raise ValueError(f"tokens_per_expert {counts} does not fit {self.num_local_experts} local experts and "
                             f"{hidden_MH.shape[0]} tokens")
        use_kernel = self.use_grouped_kernel(hidden_MH)
        offs_E = offsets(counts, hidden_MH.device) if use_kernel else None
        kwargs = dict(offs_E=offs_E, use_kernel=use_kernel, zero_empty_grads=self.options.zero_empty_expert_grads)
        fc1_MG = grouped_linear(hidden_MH, self.fc1_weight, counts, **kwargs)
        act_MF = self._activation(fc1_MG, probs_M)
        return grouped_linear(act_MF, self.fc2_weight, counts, **kwargs), None

    def backward_dw(self) -> None:
        """megatron's delayed weight-gradient hook; the gradients are computed in the backward already."""

    def _expert_keys(self, prefix: str, e: int) -> tuple[str, str]:
        return f"{prefix}local_experts.{e}.linear_fc1.", f"{prefix}local_experts.{e}.linear_fc2."

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Write SequentialMLP's keys: one ``[2F, H]`` / ``[H, F]`` view per expert and ``_extra_state`` (None)."""
        weights = [w if keep_vars else w.detach() for w in (self.fc1_weight, self.fc2_weight)]
        for e in range(self.num_local_experts):
            for base, weight in zip(self._expert_keys(prefix, e), weights):
                destination[base + "weight"] = weight[e]
                destination[base + _EXTRA_STATE] = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Read SequentialMLP's per-expert keys into the stacked weights (see :meth:`_save_to_state_dict`)."""
        expected = set()
        with torch.no_grad():
            for which, weight in enumerate((self.fc1_weight, self.fc2_weight)):
                for e in range(self.num_local_experts):
                    base = self._expert_keys(prefix, e)[which]
                    expected.update((base + "weight", base + _EXTRA_STATE))
                    key = base + "weight"
                    if key not in state_dict:
                        missing_keys.append(key)
                        continue
                    value = state_dict[key]
                    if not torch.is_tensor(value) or tuple(value.shape) != tuple(weight.shape[1:]):
                        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                        error_msgs.append(f"size mismatch for {key}: copying a param with shape {shape} from "
                                          f"checkpoint, the shape in current model is {tuple(weight.shape[1:])}.")
                        continue
                    weight[e].copy_(value)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        raise NotImplementedError("TorchGroupedMLP has no megatron distributed-checkpoint layout; save "
                                  "model.state_dict() (SequentialMLP's keys) as repro.training.checkpoint does")

    def extra_repr(self) -> str:
        E, G, H = self.fc1_weight.shape
        return f"num_local_experts={E}, hidden={H}, fc1_out={G}, expert_gemm={self.options.expert_gemm!r}"


class TorchSDPAttention(MegatronModule):
    """megatron's ``core_attention`` on torch's SDPA (``DotProductAttention``'s arguments plus ``options``); scale
    ``softmax_scale`` or ``1/sqrt(d)`` (QK layer scaling cancels out); masks: option 3.

    Raises:
        ValueError: context parallelism, a non-vanilla softmax or sliding-window attention.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, options: TorchBackendOptions | None = None) -> None:
        super().__init__(config=config)
        self.options = options or TorchBackendOptions()
        if config.context_parallel_size != 1:
            raise ValueError("TorchSDPAttention does not support context parallelism")
        if config.softmax_type != "vanilla":
            raise ValueError(f"TorchSDPAttention supports softmax_type 'vanilla' only, got '{config.softmax_type}'")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("TorchSDPAttention does not support sliding-window attention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"heads {config.num_attention_heads} / groups {config.num_query_groups} not divisible by TP {tp}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.num_heads = config.num_attention_heads // tp
        self.num_query_groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # Option 3's once-per-mask check: (weakref to last mask, its version, shape, causal). Per module.
        self._mask_check: tuple[weakref.ref, int, tuple, bool] | None = None

    def _is_causal_mask(self, mask: torch.Tensor, sq: int, sk: int) -> bool:
        """Whether ``mask`` is ``triu(ones(sq, sk), 1)`` broadcast (inference masks, lacking versions: every call)."""
        inference = mask.is_inference()
        cached = self._mask_check
        if not inference and cached is not None and cached[0]() is mask and cached[1] == mask._version \
                and cached[2] == mask.shape:
            return cached[3]
        causal = tuple(mask.shape[-2:]) == (sq, sk)
        if causal:
            expected = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
            causal = bool(torch.equal(mask, expected.expand_as(mask)))
        if not inference:
            self._mask_check = (weakref.ref(mask), mask._version, mask.shape, causal)
        return causal

    def _sdpa_mask(self, mask, mask_type, sq: int, sk: int) -> tuple[bool, torch.Tensor | None]:
        """``(is_causal, attn_mask)`` for SDPA from megatron's mask and mask type (option 3)."""
        causal_type = mask_type == AttnMaskType.causal
        if mask is None:
            # megatron's softmax builds the causal mask itself when none is given, else masks nothing.
            return causal_type, None
        if mask.dtype != torch.bool:
            raise ValueError(f"attention_mask must be bool (True = masked), got {mask.dtype}")
        mode = self.options.causal_mask
        if mode == "trust" and causal_type:
            return True, None
        if mode == "verify" and self._is_causal_mask(mask, sq, sk):
            return True, None
        return False, ~mask  # SDPA's boolean mask is True where attention IS allowed

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                attn_mask_type=None, attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """``[sq, b, heads, d]`` query, ``[sk, b, groups, d]`` key/value, bool mask -> ``[sq, b, heads * d]``."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("TorchSDPAttention supports neither attention_bias nor packed sequences")
        sq, b, heads, d = query.shape
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        is_causal, mask = self._sdpa_mask(attention_mask, mask_type, sq, key.shape[0])
        q_BHSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        # As DotProductAttention: attention dropout draws from the model-parallel RNG stream.
        forked = dropout_p > 0 and not self.config.sequence_parallel
        with get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
            context_BHSD = F.scaled_dot_product_attention(
                q_BHSD, k_BGSD, v_BGSD, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=heads != key.shape[2],
            )
        return context_BHSD.permute(2, 0, 1, 3).reshape(sq, b, heads * d)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, query_groups={self.num_query_groups}, head_dim={self.head_dim}, "
                f"causal_mask={self.options.causal_mask!r}")
