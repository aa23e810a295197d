"""megatron-core models for the suite.

- :mod:`repro.model.flavours`: frozen model configs (``tiny``, ``llama-185m`` and their ``-dense`` twins).
- :mod:`repro.model.builder`: ``build_model(flavour, router_name, ...)`` -> megatron ``GPTModel``.
- :mod:`repro.model.parallel`: ``init_distributed`` / ``destroy_distributed`` (gloo on CPU, nccl on GPU).
- :mod:`repro.model.cpu_shims`: the patches megatron-core 0.16.1 needs without CUDA.
- :mod:`repro.model.lory_layer`: Lory's parameter-merging MoE layer.

Submodules are imported on demand (megatron-core takes seconds to import).
"""
