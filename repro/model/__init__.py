"""megatron-core models for the suite (modules: docs/development.md); submodules are imported on demand, since
megatron-core takes seconds to import."""
