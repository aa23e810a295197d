"""What a run leaves behind, read and written below training, evaluation and the reports: the run record
(run_record.py) and its store (store.py), the step log (step_log.py), the FLOPs count (flops.py) and the figures
read from step logs (log_figures.py)."""
