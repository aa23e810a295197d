"""megatron-core models for the suite: ``flavours`` (frozen model configs), ``builder`` (``build_model`` ->
megatron ``GPTModel``), ``backends`` + ``torch_backend`` (the TransformerEngine-free kernels), ``parallel``
(``init_distributed``), ``cpu_shims`` (the patches megatron-core needs without CUDA). Submodules are imported on
demand (megatron-core takes seconds to import).
"""
