"""``python -m repro mini``: the whole router comparison on the embedded default (CPU, a few minutes).

1. Build (or reuse) the mini-pile, its tokenizer and indexed datasets, and the local lm-eval tasks.
2. For every router and the dense baseline, one worker process (two run at a time, one thread each):
   train ``<router>-tiny`` on the mini-pile, evaluate the checkpoint zero-shot on the local tasks through
   lm-eval, analyse its routing (expert specialisation by domain; DirMoE's sparsity knob) and write its
   run record (``runs/mini/<router>/record.json``).
3. Build the zero-shot, efficiency and routing tables (Markdown, CSV, LaTeX) and the plots under
   ``results/mini/``, and print the tables.

A router whose record matches the current settings is reused, so an interrupted comparison picks up where
it stopped; ``--fresh`` retrains everything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.errors import ReproError
from repro.io_utils import write_json_atomic

#: Everything the comparison trains: the seven routers and the dense model.
ALL_RUNS = ("dense", "switch", "dirmoe", "remoe", "expert_choice", "hash", "lory", "sparsemixer")


@dataclass(frozen=True)
class MiniConfig:
    """Settings of the embedded comparison.

    Args:
        runs: which runs (``dense`` or router names), each the ``<run>-tiny`` experiment.
        steps: training steps per run (the same for all: compute parity at the nominal k).
        data_dir: where the mini-pile is built (or found).
        work_dir: run directories (checkpoints, logs, records).
        out_dir: tables and plots.
        workers: runs trained at once (each one process with one thread).
        eval_limit: documents per local task (lm-eval's ``limit``).
        spec_tokens: held-out tokens per domain for the specialisation analysis.
        warmup_rows: log rows skipped before the efficiency window.
        overrides: extra ``key=value`` experiment overrides applied to every run.
    """

    runs: tuple[str, ...] = ALL_RUNS
    steps: int = 600
    data_dir: str = "data/mini-pile"
    work_dir: str = "runs/mini"
    out_dir: str = "results/mini"
    workers: int = 2
    eval_limit: int = 300
    spec_tokens: int = 4096
    warmup_rows: int = 2
    overrides: tuple[str, ...] = ()

    def experiment(self, run: str):
        """The run's experiment with this comparison's settings applied."""
        from repro.training.experiments import apply_overrides, get_experiment

        exp = get_experiment(f"{run}-tiny")
        return apply_overrides(exp, [f"steps={self.steps}", f"data=mini-pile:{self.data_dir}", *self.overrides])


# ------------------------------------------------------------------------------------------------ worker
def _unigram_loss(prefix: str) -> float:
    """Cross-entropy (nats/token) of the training tokens under their own unigram distribution."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(prefix)
    counts = np.zeros(1, dtype=np.int64)
    for i in range(len(data)):
        ids = np.asarray(data[i], dtype=np.int64)
        if ids.size:
            if ids.max() >= counts.size:
                counts = np.pad(counts, (0, int(ids.max()) + 1 - counts.size))
            counts += np.bincount(ids, minlength=counts.size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _heldout_documents(heldout_path: Path, tokenizer) -> list[tuple[list[int], str]]:
    docs = []
    with open(heldout_path) as f:
        for line in f:
            rec = json.loads(line)
            docs.append((tokenizer.tokenize(rec["text"]) + [tokenizer.eod], rec["meta"]["pile_set_name"]))
    return docs


def run_worker(cfg: MiniConfig, run: str, tasks_dir: Path) -> Path:
    """Train, evaluate, analyse and record one run (the body of a worker process).

    Args:
        cfg: the comparison's settings.
        run: ``dense`` or a router name.
        tasks_dir: the local lm-eval tasks.

    Returns:
        The run's record path.
    """
    import torch

    from repro.analysis import expert_specialisation, sparsity_knob, trace_routers
    from repro.evaluation.harness import DirMoEBenchLM
    from repro.evaluation.runner import evaluate_lm
    from repro.report.records import record_from_run_dir, write_record
    from repro.training.inference import load_for_evaluation
    from repro.training.loop import train

    torch.set_num_threads(1)
    experiment = cfg.experiment(run)
    run_dir = Path(cfg.work_dir) / run
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a stale or partial run of other settings: start clean
    train(experiment, run_dir, progress=False)

    scorer, tokenizer = load_for_evaluation(run_dir, device="cpu")
    # Batch 1: Expert Choice (and capacity dropping) couple the tokens of a batch; scoring each request
    # alone keeps every router's numbers independent of how lm-eval groups requests.
    lm = DirMoEBenchLM(model=scorer, tokenizer=tokenizer, batch_size=1)
    results = evaluate_lm(lm, local_tasks=tasks_dir, limit=cfg.eval_limit, bootstrap_iters=0)

    from repro.data.minipile import build_mini_pile

    mini = build_mini_pile(cfg.data_dir)
    analysis: dict[str, Any] = {"run": run, "settings": _analysis_settings(cfg)}
    docs = _heldout_documents(mini.heldout_path, tokenizer)
    if experiment.router:
        analysis["specialisation"] = expert_specialisation(
            scorer.logits, scorer.model, docs, scorer.max_length, cfg.spec_tokens
        )
    if experiment.router == "dirmoe":
        window = [t for ids, _ in docs[:8] for t in ids][: scorer.max_length]
        with trace_routers(scorer.model, keep_inputs=True) as trace:
            scorer.logits(torch.tensor([window]))
        router = next(m for m in scorer.model.modules() if getattr(m, "name", "") == "dirmoe")
        # 0.3 .. 1000: below ~0.3 the smallest concentrations (~1e-3) underflow the Gamma draws to 0.
        lambdas = [10 ** (e / 4) for e in range(-2, 13)]
        analysis["sparsity_knob"] = sparsity_knob(router, trace.inputs[0][0], lambdas)
        analysis["num_experts"] = router.num_experts
    write_json_atomic(run_dir / "analysis.json", analysis)

    record = record_from_run_dir(run_dir, warmup=cfg.warmup_rows, lm_eval_results=results, run_id=run)
    return write_record(record, run_dir / "record.json")


def _analysis_settings(cfg: MiniConfig) -> dict[str, Any]:
    """The settings besides the experiment that a finished run's record and analysis depend on."""
    return {"eval_limit": cfg.eval_limit, "spec_tokens": cfg.spec_tokens, "warmup_rows": cfg.warmup_rows}


def _record_is_current(cfg: MiniConfig, run: str) -> bool:
    run_dir = Path(cfg.work_dir) / run
    if not ((run_dir / "record.json").is_file() and (run_dir / "analysis.json").is_file()):
        return False
    try:
        stored = json.loads((run_dir / "config.json").read_text())["experiment"]
        settings = json.loads((run_dir / "analysis.json").read_text()).get("settings")
    except (OSError, ValueError, KeyError):
        return False
    return stored == cfg.experiment(run).to_dict() and settings == _analysis_settings(cfg)


# -------------------------------------------------------------------------------------------- reporting
def _report(cfg: MiniConfig, unigram: float, elapsed: float) -> str:
    from repro.report.plots import (
        plot_loss_curves,
        plot_routing_over_training,
        plot_sparsity_knob,
        plot_specialisation,
        specialisation_score,
    )
    from repro.report.records import load_record, read_log_jsonl
    from repro.report.tables import efficiency_table, render, routing_table, write_tables, zero_shot_table

    out = Path(cfg.out_dir)
    records = [load_record(Path(cfg.work_dir) / run / "record.json") for run in cfg.runs]
    tables = [zero_shot_table(records), efficiency_table(records), routing_table(records)]
    write_tables(tables, out)

    logs = {run: read_log_jsonl(Path(cfg.work_dir) / run / "log.jsonl") for run in cfg.runs}
    analyses = {run: json.loads((Path(cfg.work_dir) / run / "analysis.json").read_text()) for run in cfg.runs}
    plot_loss_curves(logs, out / "loss_curves.png", unigram_loss=unigram)
    plot_routing_over_training({r: rows for r, rows in logs.items() if r != "dense"}, out / "routing_over_training.png")
    specs = {r: a["specialisation"] for r, a in analyses.items() if "specialisation" in a}
    pair = {r: specs[r] for r in ("dirmoe", "switch") if r in specs}
    plot_specialisation(pair, out / "specialisation_dirmoe_vs_switch.png")
    plot_specialisation(specs, out / "specialisation_all.png")
    if "dirmoe" in analyses and "sparsity_knob" in analyses["dirmoe"]:
        plot_sparsity_knob(analyses["dirmoe"]["sparsity_knob"], out / "dirmoe_sparsity_knob.png", analyses["dirmoe"]["num_experts"])

    final = {run: sum(r["lm_loss"] for r in rows[-10:]) / len(rows[-10:]) for run, rows in logs.items()}
    val = {run: next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), math.nan) for run, rows in logs.items()}
    summary = {
        "steps": cfg.steps,
        "wall_seconds": round(elapsed, 1),
        "unigram_loss": unigram,
        "final_train_lm_loss_last10": final,
        "validation_loss": val,
        "specialisation_score": {r: specialisation_score(s) for r, s in specs.items()},
        "command": "nox -s mini  (python -m repro mini)",
    }
    write_json_atomic(out / "summary.json", summary)

    lines = [render(t, "md") for t in tables]
    lines.append(f"Unigram baseline loss: {unigram:.3f} nats/token. Final training LM loss (mean of last 10 steps):")
    lines.append(
        "  " + ", ".join(f"{r} {final[r]:.3f}" for r in cfg.runs)
    )
    lines.append("Specialisation score (0 = domains routed alike; 1 = disjoint experts): " + ", ".join(
        f"{r} {v:.3f}" for r, v in summary["specialisation_score"].items()
    ))
    lines.append(f"Tables and plots in {out}/; wall time {elapsed / 60:.1f} min.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main
def _parse(argv: list[str], prog: str) -> tuple[MiniConfig, argparse.Namespace]:
    defaults = MiniConfig()
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(defaults.runs), help="comma-separated: dense and router names")
    p.add_argument("--steps", type=int, default=defaults.steps, help="training steps per run")
    p.add_argument("--workers", type=int, default=defaults.workers, help="runs trained at once")
    p.add_argument("--eval-limit", type=int, default=defaults.eval_limit, help="documents per local task")
    p.add_argument("--data-dir", default=defaults.data_dir)
    p.add_argument("--work-dir", default=defaults.work_dir)
    p.add_argument("--out", default=defaults.out_dir, help="tables and plots")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="experiment override for every run")
    p.add_argument("--fresh", action="store_true", help="retrain every run even if its record is current")
    p.add_argument("--worker", metavar="RUN", help=argparse.SUPPRESS)  # internal: one run in this process
    p.add_argument("--tasks-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    unknown = [r for r in runs if r not in ALL_RUNS]
    if unknown or not runs:
        raise ReproError(f"--runs: unknown run(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(ALL_RUNS)}")
    for name, value in (("--steps", args.steps), ("--workers", args.workers), ("--eval-limit", args.eval_limit)):
        if value < 1:
            raise ReproError(f"{name} must be >= 1, got {value}")
    cfg = MiniConfig(
        runs=runs,
        steps=args.steps,
        data_dir=args.data_dir,
        work_dir=args.work_dir,
        out_dir=args.out,
        workers=args.workers,
        eval_limit=args.eval_limit,
        overrides=tuple(args.set),
    )
    for run in runs:
        cfg.experiment(run)  # unknown keys / bad values: one-line error before any work
    return cfg, args


def _worker_command(cfg: MiniConfig, run: str, tasks_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "repro", "mini", "--worker", run, "--tasks-dir", str(tasks_dir)]
    cmd += ["--steps", str(cfg.steps), "--eval-limit", str(cfg.eval_limit), "--runs", run]
    cmd += ["--data-dir", cfg.data_dir, "--work-dir", cfg.work_dir, "--out", cfg.out_dir]
    for item in cfg.overrides:
        cmd += ["--set", item]
    return cmd


def main(argv: list[str], prog: str = "python -m repro mini") -> int:
    """Run the comparison (or, with the internal ``--worker``, one run of it). Returns the exit status."""
    cfg, args = _parse(argv, prog)
    if args.worker:
        run_worker(cfg, args.worker, Path(args.tasks_dir))
        return 0

    from tqdm import tqdm

    from repro.data.minipile import build_mini_pile
    from repro.evaluation.local_tasks import build_local_tasks

    start = time.perf_counter()
    mini = build_mini_pile(cfg.data_dir, log=print)
    tasks_dir = build_local_tasks(mini.heldout_path, Path(cfg.work_dir) / "tasks")
    todo = [r for r in cfg.runs if args.fresh or not _record_is_current(cfg, r)]
    reused = [r for r in cfg.runs if r not in todo]
    if reused:
        print(f"reusing finished runs: {', '.join(reused)}")
    print(f"training {len(todo)} runs x {cfg.steps} steps, {cfg.workers} at a time (logs in {cfg.work_dir}/<run>/)")

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)

    def launch(run: str) -> tuple[str, int, float]:
        t0 = time.perf_counter()
        log_path = Path(cfg.work_dir) / f"{run}.worker.log"
        with open(log_path, "w") as log:
            rc = subprocess.run(_worker_command(cfg, run, tasks_dir), stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        return run, rc, time.perf_counter() - t0

    failed = []
    with ThreadPoolExecutor(max_workers=cfg.workers) as pool, tqdm(total=len(todo), desc="runs", unit="run") as bar:
        for run, rc, seconds in pool.map(launch, todo):
            bar.update(1)
            bar.write(f"  {run}: {'done' if rc == 0 else f'FAILED (exit {rc})'} in {seconds:.0f} s")
            if rc != 0:
                failed.append(run)
    if failed:
        logs = ", ".join(str(Path(cfg.work_dir) / f"{r}.worker.log") for r in failed)
        raise ReproError(f"run(s) {', '.join(failed)} failed; see {logs}")

    unigram = _unigram_loss(mini.train_prefix)
    print(_report(cfg, unigram, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
