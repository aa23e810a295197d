"""Build LLaMA-style megatron-core GPT models with any registered router in every block.

Call :func:`repro.model.parallel.init_distributed` first (megatron needs its parallel state). Forward::

    mask = causal_attention_mask(S, device)                  # always pass it: see cpu_shims (shim 3)
    with token_ids_context(model, input_ids_BS):            # needed by Hash, harmless for the others
        loss_BS = model(input_ids_BS, position_ids_BS, mask, labels=labels_BS)   # per-token CE, fp32
    logits_BSV = model(input_ids_BS, position_ids_BS, mask)                        # without labels

Routers plug in via ``MoESubmodules.router`` (:mod:`routers.megatron_adapter`); ``"megatron"`` keeps
``TopKRouter``. Backends: docs/efficiency.md. GPU: bf16 parameters, fp32 routers (never ``model.bfloat16()``).
Attributes: ``model.config`` (TransformerConfig, for FLOPs), ``model.flavour``, ``model.backend``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from repro.errors import unknown_name
from repro.flavours import MEGATRON_ROUTER, MEGATRON_ROUTER_OPTIONS, ModelFlavour, get_flavour, refuse_unknown
from repro.model.backends import TorchBackendOptions, resolve_backend
from repro.model.cpu_shims import apply_cpu_shims, causal_attention_mask, cuda_available, seed_model_parallel_rng

__all__ = ["MEGATRON_ROUTER", "build_model", "causal_attention_mask", "transformer_config"]


def transformer_config(flavour: str | ModelFlavour, router_name: str | None = None,
                       router_options: dict[str, Any] | None = None, *, bf16: bool | None = None,
                       backend: str | None = None, tp: int = 1, ep: int = 1):
    """The megatron-core TransformerConfig of a flavour (also what FLOPs are computed from).

    Args:
        router_name: only ``"megatron"`` changes the config (enables TopKRouter's aux loss).
        router_options: for ``"megatron"``: ``aux_loss_coeff`` (default 1e-2), ``z_loss_coeff``, ``capacity_factor``.
        bf16: bf16 parameters; default: on GPU only.
        backend: as :func:`build_model`'s; decides fusions (:func:`fusions_enabled`; ``"te"``: also grouped GEMM).
        tp, ep: tensor/expert-parallel sizes (must match megatron's parallel_state).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    flavour = get_flavour(flavour)
    on_gpu = cuda_available()
    bf16 = on_gpu if bf16 is None else bf16
    resolved = resolve_backend(backend)
    use_te = resolved == "te"
    fused = fusions_enabled(resolved, on_gpu)
    kwargs: dict[str, Any] = dict(
        num_layers=flavour.num_layers, hidden_size=flavour.hidden_size, ffn_hidden_size=flavour.ffn_hidden_size,
        num_attention_heads=flavour.num_attention_heads, num_query_groups=flavour.num_query_groups,
        kv_channels=flavour.kv_channels, normalization="RMSNorm", layernorm_epsilon=flavour.layernorm_epsilon,
        gated_linear_unit=True, activation_func=F.silu,  # SwiGLU
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=flavour.init_method_std,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep if flavour.is_moe else 1,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        # Compiled fusions as the papers' Megatron-LM runs (docs/efficiency.md); fused CE casts its gradient to
        # bf16 (bf16 models only); RoPE and masked-softmax fusions need TE; Apex's stay off.
        bias_activation_fusion=fused,
        cross_entropy_loss_fusion=fused and bf16,
        cross_entropy_fusion_impl="native",
        bias_dropout_fusion=False,
        masked_softmax_fusion=use_te and on_gpu,
        persist_layer_norm=False,
        apply_rope_fusion=use_te and on_gpu,
        gradient_accumulation_fusion=False,
    )
    if flavour.is_moe:
        megatron_router = router_name == MEGATRON_ROUTER
        options = dict(router_options or {}) if megatron_router else {}
        refuse_unknown(options, MEGATRON_ROUTER_OPTIONS, "option", " for router 'megatron'")
        kwargs.update(
            num_moe_experts=flavour.num_experts, moe_router_topk=flavour.top_k,
            moe_ffn_hidden_size=flavour.ffn_hidden_size, moe_token_dispatcher_type=flavour.token_dispatcher,
            # Required for k=1 in megatron-core 0.16.1, and the dMoE/Switch convention (softmax, then top-k).
            moe_router_pre_softmax=True, moe_router_score_function="softmax", moe_router_dtype="fp32",
            # Our routers add their own aux losses through the adapter; only TopKRouter uses megatron's.
            moe_router_load_balancing_type="aux_loss" if megatron_router else "none",
            moe_aux_loss_coeff=options.get("aux_loss_coeff", 1e-2) if megatron_router else 0.0,
            moe_z_loss_coeff=options.get("z_loss_coeff"),
            moe_expert_capacity_factor=options.get("capacity_factor"),
            moe_grouped_gemm=bool(use_te and _moe_layer_class(router_name) is None),
            moe_permute_fusion=False,
        )
    # cuda_graph_scope: megatron's default ("full") is its deprecated spelling of [] and warns on every build.
    return TransformerConfig(**kwargs, cuda_graph_scope=[])


def fusions_enabled(backend: str, on_gpu: bool) -> bool:
    """Whether megatron's compiled fusions (SwiGLU, bf16 CE) are on: ``te``/``torch`` on a GPU with inductor."""
    if not on_gpu or backend not in ("te", "torch"):
        return False
    from routers.dirmoe_blocks import inductor_available

    return inductor_available(torch.device("cuda"))[0]


def _moe_layer_class(router_name: str | None) -> type | None:
    """The router's own MoE layer class (``Router.moe_layer_class()``), None for megatron's MoELayer."""
    if router_name is None or router_name == MEGATRON_ROUTER:
        return None
    from routers import router_class

    return router_class(router_name).moe_layer_class()


def _replace_submodules(spec, **submodules):
    """A copy of a ModuleSpec with some submodules replaced (never mutated: specs may share sub-objects)."""
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **submodules))


def _layer_spec(flavour: ModelFlavour, config, router_name: str | None, router_options, backend: str,
                backend_options: TorchBackendOptions):
    """The layer ModuleSpec of a resolved ``backend`` with our router (and its own MoE layer) plugged in; ``torch``:
    the local spec with SDPA attention and (unless the router has its own MoE layer) grouped-GEMM experts."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.spec_utils import ModuleSpec

    num_experts = flavour.num_experts
    if backend == "te":  # GPU machines with TransformerEngine only
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm")
    if backend == "torch":
        from repro.model.torch_backend import TorchGroupedMLP, TorchSDPAttention

        attention = spec.submodules.self_attention
        core_attention = functools.partial(TorchSDPAttention, options=backend_options)
        spec = _replace_submodules(spec, self_attention=_replace_submodules(attention, core_attention=core_attention))
    if not flavour.is_moe:
        return spec

    mlp_spec = spec.submodules.mlp
    layer_class = _moe_layer_class(router_name)
    if layer_class is not None:
        # Such layers (Lory's) merge SequentialMLP parameters: local experts even when TE runs the rest.
        mlp_spec = get_moe_module_spec_for_backend(backend=LocalSpecProvider(), num_experts=num_experts)
        mlp_spec = dataclasses.replace(mlp_spec, module=layer_class)
    elif backend == "torch":
        experts = ModuleSpec(module=TorchGroupedMLP, params={"options": backend_options})
        mlp_spec = _replace_submodules(mlp_spec, experts=experts)
    if router_name != MEGATRON_ROUTER:
        from routers.megatron_adapter import megatron_router_builder

        mlp_spec = _replace_submodules(mlp_spec, router=megatron_router_builder(router_name, router_options))
    return _replace_submodules(spec, mlp=mlp_spec)


def _quiet_megatron_notices(build):
    """Silence megatron notices that do not apply: Apex absent (on purpose), "Unknown MLP type" (Lory's layer)."""

    def drop(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unknown MLP type")

    @functools.wraps(build)
    def quiet(*args, **kwargs):
        from routers.registry import quiet_megatron_import

        logger = logging.getLogger("megatron.core.transformer.transformer_layer")
        with quiet_megatron_import():
            logger.addFilter(drop)
            try:
                return build(*args, **kwargs)
            finally:
                logger.removeFilter(drop)

    return quiet


@_quiet_megatron_notices
def build_model(flavour: str | ModelFlavour, router_name: str | None = None,
                router_options: dict[str, Any] | None = None, vocab_size: int | None = None, *,
                seq_length: int | None = None, bf16: bool | None = None, backend: str | None = None,
                backend_options: TorchBackendOptions | dict[str, Any] | None = None, seed: int | None = None,
                fused_cross_entropy: str = "none"):
    """Build a LLaMA-style megatron-core ``GPTModel`` with ``router_name`` in every block's MoE layer.

    Args:
        flavour: flavour or its name (``repro.flavours.available_flavours()``).
        router_name: a registered router, ``"megatron"`` (TopKRouter), or None (dense flavours only).
        router_options: config fields (``"megatron"``: :func:`transformer_config`); Hash's ``vocab_size``: padded.
        vocab_size: tokenizer vocabulary (padded to a multiple of 128 in the model); default the flavour's.
        seq_length: overrides the flavour's (RoPE's maximum position).
        bf16: bf16 parameters (default: on GPU only).
        backend: ``"auto"`` (default), ``"te"``, ``"torch"`` or ``"local"`` (:func:`resolve_backend`).
        backend_options: :class:`~repro.model.backends.TorchBackendOptions` or a dict of its fields.
        seed: re-seed torch and megatron's RNG tracker just before construction (same seed, same weights).
        fused_cross_entropy: :data:`~repro.model.fused_loss.FUSED_CROSS_ENTROPY`; not ``"none"``: a
            :class:`~repro.model.fused_loss.FusedLossGPTModel` (same parameters; TP 1 only).

    Returns:
        The ``GPTModel`` on this process's device (attributes: module docstring).

    Raises:
        ValueError: unknown name or option, ``"te"`` without TE, router/flavour mismatch, fused CE with TP > 1.
        RuntimeError: megatron's parallel state is not initialised.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    on_gpu = not apply_cpu_shims()  # patched only without CUDA
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron's parallel state is not initialised: call repro.model.parallel.init_distributed()")

    overrides = {k: v for k, v in (("vocab_size", vocab_size), ("seq_length", seq_length)) if v is not None}
    flavour = get_flavour(flavour, **overrides)
    if flavour.vocab_size is None:
        raise ValueError(f"flavour '{flavour.name}' takes its vocabulary from the tokenizer: pass vocab_size")

    if flavour.is_moe:
        from routers import available_routers, router_class

        names = [MEGATRON_ROUTER, *available_routers()]
        if router_name is None:
            raise ValueError(f"flavour '{flavour.name}' is an MoE model and needs a router; "
                             f"available: {', '.join(names)}")
        if router_name not in names:
            raise ValueError(unknown_name("router", router_name, names))
    elif router_name is not None:
        raise ValueError(f"flavour '{flavour.name}' is dense and takes no router (got '{router_name}')")

    tp = parallel_state.get_tensor_model_parallel_world_size()
    padded_vocab = flavour.padded_vocab_size(tp=tp)
    if flavour.is_moe and router_name != MEGATRON_ROUTER:
        # Hash's table size: the padded vocabulary unless set.
        router_options = dict(router_options or {})
        if "vocab_size" in {f.name for f in dataclasses.fields(router_class(router_name).Config)}:
            router_options.setdefault("vocab_size", padded_vocab)

    backend = resolve_backend(backend)
    if not isinstance(backend_options, TorchBackendOptions):  # a dict of its fields, or None: the defaults
        options = {} if backend_options is None else backend_options
        if not isinstance(options, dict):
            raise ValueError(f"backend_options must be a TorchBackendOptions or a dict, got {type(options).__name__}")
        refuse_unknown(options, [f.name for f in dataclasses.fields(TorchBackendOptions)], "backend option")
        backend_options = TorchBackendOptions(**options)
    ep = parallel_state.get_expert_model_parallel_world_size()
    config = transformer_config(flavour, router_name, router_options, bf16=bf16, backend=backend, tp=tp, ep=ep)
    spec = _layer_spec(flavour, config, router_name, router_options, backend, backend_options)

    if seed is not None:
        # torch's generator (CPU init, our routers) and megatron's tracker (GPU init of parallel layers).
        seed_model_parallel_rng(seed)
    model_class, fused_kwargs = GPTModel, {}
    if fused_cross_entropy != "none":
        # Imported only when asked for (its torch.compile loads dynamo).
        from repro.model.fused_loss import FusedLossGPTModel  # checks the name before building

        model_class, fused_kwargs = FusedLossGPTModel, dict(fused_cross_entropy=fused_cross_entropy)
    model = model_class(
        config=config, transformer_layer_spec=spec, vocab_size=padded_vocab, max_sequence_length=flavour.seq_length,
        position_embedding_type="rope", rotary_base=flavour.rotary_base,
        share_embeddings_and_output_weights=False, parallel_output=True, **fused_kwargs,  # untied embeddings
    )
    if config.bf16:
        _norms_to_bf16(model)
    if on_gpu:
        # megatron allocates its parameters on the GPU already; our routers are built on the CPU.
        model.cuda(torch.cuda.current_device())
    model.flavour = flavour
    model.backend = backend
    # Each router class with ``link_layers`` gets its routers in layer order (cross-layer losses: SparseMixer-v2).
    from routers.schedule import routers_in

    found = routers_in(model)
    for cls in dict.fromkeys(type(router) for router in found):
        if getattr(cls, "link_layers", None) is not None:
            cls.link_layers([router for router in found if type(router) is cls])
    return model


def _norms_to_bf16(model: torch.nn.Module) -> None:
    """bf16 norms outside the routers, as Megatron-LM's ``Float16Module``: without TE/Apex megatron builds fp32
    ``torch.nn.RMSNorm``, and with bf16 input ``torch.rms_norm`` misses its fused kernel (results/h100/bf16-norms)."""
    from routers.schedule import routers_in

    inside_routers = {id(m) for router in routers_in(model) for m in router.modules()}
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)) and id(module) not in inside_routers:
            module.to(torch.bfloat16)
