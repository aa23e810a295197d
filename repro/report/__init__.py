"""Presentation of the records: tables (``tables`` per run, ``seed_tables`` over seeds, ``ablation_tables``,
shared in ``table_core``), compute parity (``compute_parity``), published numbers (``published``), plots,
regression checks (``check``) and the words of the result write-ups (``verdicts``; each study's write-up is its own,
in :mod:`repro.studies`).
"""
