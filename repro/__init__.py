"""Reproduction pipelines: data, megatron-core models, training, evaluation, tables and checks."""
