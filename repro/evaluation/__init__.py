"""Zero-shot evaluation through lm-eval, offline: ``harness`` (the lm-eval ``LM``), ``runner``
(``simple_evaluate``), ``local_tasks`` (tasks over the mini-pile's held-out documents), ``task_data`` (the
papers' tasks from datasets on disk), ``cli`` / ``data_cli`` (``python -m repro eval run`` / ``eval fetch|check``),
``offline``. Importing this package does not import lm-eval.
"""
