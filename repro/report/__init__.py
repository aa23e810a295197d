"""Measurement and reporting: run records, FLOPs, compute parity, tables, regression checks, published numbers.

Modules: ``records`` (the run record and helpers that build it from a training log), ``flops`` (Megatron-LM's
model FLOPs), ``parity`` (compute parity between routers), ``ledger`` (published numbers with provenance),
``tables`` (zero-shot / efficiency / routing tables), ``check`` (regression checks), ``bench_table``
(pytest-benchmark summary), ``cli`` (``python -m repro tables`` / ``check``), ``schema`` (typed JSON loading).
"""
