"""Measurement and reporting: run records (``record``, ``store``), FLOPs and compute parity (``flops``,
``parity``), published numbers (``ledger``), tables (``tables``, ``seed_tables``, ``ablation_tables``, shared in
``table_core``), plots, regression checks (``check``) and the result write-ups (``writeup``).
"""
