"""Zero-shot evaluation through lm-eval, offline.

Modules: ``harness`` (the lm-eval ``LM`` registered as ``dirmoe-bench``; checkpoint loading is wired in
``harness.load_scoring_model``), ``local_tasks`` (lm-eval tasks over the mini-pile's held-out documents),
``runner`` (``simple_evaluate`` on full-scale and local tasks), ``task_data`` (the papers' tasks from datasets on
disk: ``--tasks-data``), ``cli`` (``python -m repro eval``), ``data_cli`` (``python -m repro eval-data``:
fetch or check a task-data folder), ``offline`` (keeps lm-eval and datasets off the network). Importing this
package does not import lm-eval.
"""
