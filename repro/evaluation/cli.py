"""``python -m repro eval``: zero-shot evaluation of a checkpoint through lm-eval, offline (docs/evaluation.md).

The checkpoint may be a run directory (newest checkpoint), its ``checkpoints`` directory or one checkpoint; the
run's ``record.json`` gets the results, per-question results (not in ``--out``) and any partial tasks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from repro.evaluation.offline import ensure_offline
from repro.io_utils import comma_list


def main(argv: list[str], prog: str) -> int:
    """Run the evaluation and write lm-eval's results JSON; returns the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description="Zero-shot evaluation of a checkpoint through lm-eval (offline).")
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory written by the training loop")
    parser.add_argument("--tasks", type=comma_list, default=None,
                        help="comma-separated lm-eval tasks (default: the local tasks with --local-tasks, else "
                        "arc_challenge,arc_easy,boolq,hellaswag,lambada_openai,piqa,race)")
    parser.add_argument("--local-tasks", default=None, help="directory of local task YAMLs (build_local_tasks)")
    parser.add_argument("--tasks-data", default=None,
                        help="task-data folder: the tasks (default: the seven) read their datasets from it with "
                        "lm-eval's own task YAMLs (fill it with `python -m repro eval fetch --out DIR` on a "
                        "machine with network access)")
    parser.add_argument("--local-tasks-from", default=None,
                        help="build the local tasks into --local-tasks from this held-out jsonl first")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (quick checks only: the record and every table mark cut tasks as partial)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=None, help="context cap in tokens (default: the model's)")
    parser.add_argument("--device", default=None, help="device for the model (default: the loader's)")
    parser.add_argument("--bootstrap-iters", type=int, default=1000, help="resamples for standard errors (0: none)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", required=True, help="where to write lm-eval's results JSON")
    args = parser.parse_args(argv)

    ensure_offline()  # before lm-eval / datasets are imported
    from lm_eval.utils import make_table

    from repro.errors import ReproError
    from repro.evaluation.harness import SuiteLM
    from repro.evaluation.local_tasks import build_local_tasks, is_local_tasks_dir
    from repro.evaluation.runner import evaluate_lm
    from repro.io_utils import check_output_path, write_json_atomic

    # Check output paths before minutes of evaluation (only this command's own output may be replaced).
    check_output_path(args.out, replace=is_lm_eval_results, probe=True)
    if args.local_tasks_from is not None:
        if args.local_tasks is None:
            raise ReproError("--local-tasks-from needs --local-tasks (the directory to write the tasks to)")
        check_output_path(args.local_tasks, replace=is_local_tasks_dir, probe=True)
        build_local_tasks(args.local_tasks_from, args.local_tasks)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    lm = SuiteLM.from_checkpoint(args.checkpoint, batch_size=args.batch_size, max_length=args.max_length,
                                 device=args.device)
    results = evaluate_lm(lm, args.tasks, local_tasks=args.local_tasks, tasks_data=args.tasks_data, limit=limit,
                          bootstrap_iters=args.bootstrap_iters, seed=args.seed, log_samples=True)
    # Samples go into the record only as per-question scores.
    write_json_atomic(args.out, {k: v for k, v in results.items() if k != "samples"}, replace=is_lm_eval_results)
    print(make_table(results))
    print(f"wrote {args.out}")
    # Put the results into the run's ``record.json`` if any; partial results never replace complete ones.
    from repro.records.store import load_record, with_lm_eval, write_record
    from repro.training.inference import resolve_checkpoint, run_dir_of

    try:
        path = run_dir_of(resolve_checkpoint(Path(args.checkpoint))) / "record.json"
    except ReproError:
        return 0  # not a training run's checkpoint layout
    if path.is_file():
        before = load_record(path)
        record = with_lm_eval(before, results, origin=str(path))
        if record.partial and before.lm_eval is not None and not before.partial:
            print(f"left {path} as it is: it holds complete zero-shot results and these are partial (--limit); "
                  f"they are in {args.out}")
            return 0
        write_record(record, path)
        partial = "; partial: " + ", ".join(p.describe() for p in record.partial) if record.partial else ""
        print(f"updated {path}{partial}")
    return 0


def is_lm_eval_results(path: Path) -> bool:
    """Whether ``path`` is a results file this command wrote, the only file ``--out`` may replace."""
    try:
        if Path(path).stat().st_size > 256 << 20:  # too large for results (a checkpoint may be)
            return False
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "results" in data and "versions" in data
