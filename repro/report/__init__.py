"""Presentation of the records: tables (``tables`` per run, ``seed_tables`` over seeds, ``ablation_tables``,
shared in ``table_core``), compute parity (``compute_parity``), published numbers (``published``), plots,
regression checks (``check``) and the result write-ups (``writeup``: each
study's in ``study_writeups``, worded by ``verdicts``).
"""
