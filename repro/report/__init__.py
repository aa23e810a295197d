"""Measurement and reporting: run records, FLOPs, compute parity, tables, regression checks, published numbers.

Modules: ``record`` (the run record's schema), ``efficiency`` (loss curve, routing and efficiency figures
from a training log; the summary and table of ``python -m repro efficiency``), ``store`` (building, writing,
finding and loading records), ``flops`` (Megatron-LM's model FLOPs), ``parity`` (compute parity between
routers), ``ledger`` (published numbers with provenance), ``tables`` (zero-shot / efficiency / routing /
validation tables), ``seed_tables`` (tables over seeds), ``table_core`` (what the tables share, rendering),
``plots``, ``check`` (regression checks), ``bench_table`` (pytest-benchmark summary), ``cli``
(``python -m repro tables`` / ``check``).
"""
