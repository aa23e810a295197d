"""``python -m repro mini``: the whole router comparison on the embedded default (CPU, a few minutes).

1. Build (or reuse) the mini-pile, its tokenizer and indexed datasets, and the local lm-eval tasks.
2. For the dense baseline, every registered router (``routers.available_routers()``, routers of other
   packages included) and the routers' declared variants (``Router.variants``: DirMoE's centred
   reconstruction target), and for each of ``--seeds N`` seeds, :func:`run_one` in a pool of worker
   processes (two at a time, one thread each): train ``<router>-tiny`` on the mini-pile, evaluate the
   checkpoint zero-shot on the local tasks through lm-eval (with lm-eval's standard errors and its
   per-document samples, kept in the record as per-question results), measure the LM loss per domain on the
   mini-pile's held-out documents, analyse its routing (expert specialisation by domain; the sparsity knob of
   routers with a Dirichlet posterior) and write its run record (``runs/mini/<run>/record.json``).
3. Build the zero-shot, efficiency, routing and validation-loss tables of the first seed's runs (Markdown,
   CSV, LaTeX) and the plots under ``results/mini/``; with several seeds also the tables over seeds (mean +-
   95% CI, ``*`` where a router differs from Switch by a paired test over the seeds, Holm-adjusted); print the
   tables.

Seeds (decision 1): seed k of a run is the experiment's own seed plus k, in ``runs/mini/<run>`` for k = 0 and
``runs/mini/<run>-s<k>`` (run id ``<run>-s<k>``) for k >= 1. Seed 0 is exactly the single-seed run: its
config, directory and record are unchanged by ``--seeds``, so ``--seeds 1`` reproduces the committed
results, and adding seeds reuses the runs already done. The seed drives the initialisation, the routers' noise
and megatron's dataset shuffles (the data order); torch and numpy seed Mersenne Twister generators, whose
initialisation spreads the seed over the whole state, so consecutive seeds give unrelated streams.

Held-out loss per domain (decision 2): after training, the checkpoint scores the first ``domain_tokens``
tokens of each domain's held-out documents (``heldout.jsonl`` of the mini-pile: never in the training shards,
the tokenizer or megatron's splits), each document cut into windows of the model's sequence length, one window
per forward (batch 1, so routers that couple a batch's tokens see one window, as in lm-eval). The same tokens
for every router and seed, so differences are paired; chosen over a per-domain breakdown of the trainer's
validation loss, whose ``validation.iters`` micro-batches (2 x 4 x 128 tokens on the tiny flavour) leave a few
hundred tokens per domain and a different mix for every seed.

A run whose record matches the current settings is reused, so an interrupted comparison picks up where it
stopped; ``--fresh`` retrains everything. A run directory is replaced only if this command created it (it
holds the marker ``.mini-run``); anything else at that path is refused, never deleted.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from repro.errors import ReproError
from repro.io_utils import claim_run_dir, write_json_atomic
from repro.training.config import MEGATRON_ROUTER, RunConfig

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from repro.report.record import DomainLoss

#: The marker a run directory created by this command holds (only such directories are ever replaced).
RUN_MARKER = ".mini-run"
#: The marker of an output directory (``--out``) this command wrote: the only non-empty one it writes into.
OUT_MARKER = ".mini-out"
COMMAND = "python -m repro mini"
DENSE = "dense"


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
        eval_limit: documents per local task (lm-eval's ``limit``; above every local task's size, so nothing is
            cut).
        spec_tokens: held-out tokens per domain for the specialisation analysis.
        warmup_rows: log rows skipped before the efficiency window.
        overrides: extra dot-list overrides applied to every run.
        pair: the two routers of the side-by-side specialisation plot (the DirMoE paper's figure).
        seeds: runs per router, seeds ``seed + k`` for k < seeds (module docstring, decision 1).
        domain_tokens: held-out tokens scored per domain for the per-domain loss (decision 2).
        bootstrap_iters: lm-eval's ``bootstrap_iters``: > 0 switches its standard errors on (closed-form for
            the accuracies; resamples for the last-word perplexity).
    """

    runs: tuple[str, ...]
    steps: int = 600
    data_dir: str = "data/mini-pile"
    work_dir: str = "runs/mini"
    out_dir: str = "results/mini"
    workers: int = 2
    eval_limit: int = 300
    spec_tokens: int = 4096
    warmup_rows: int = 2
    overrides: tuple[str, ...] = ()
    pair: tuple[str, str] = ("dirmoe", "switch")
    seeds: int = 1
    domain_tokens: int = 8192
    bootstrap_iters: int = 1000

    def __post_init__(self) -> None:
        for name in ("steps", "workers", "eval_limit", "spec_tokens", "seeds", "domain_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_rows", "bootstrap_iters"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def experiment(self, run: str, seed_index: int = 0):
        """The run's config with this comparison's settings applied; seed ``seed + seed_index``."""
        from repro.training.config import apply_overrides
        from repro.training.experiments import get_experiment

        config = get_experiment(f"{run}-tiny")
        config = apply_overrides(config, [f"schedule.steps={self.steps}", f"data.source=mini-pile:{self.data_dir}", *self.overrides])
        # Seed 0 is left exactly as it was (no override at all): the single-seed run, reused as is.
        return apply_overrides(config, [f"seed={config.seed + seed_index}"]) if seed_index else config

    def run_id(self, run: str, seed_index: int = 0) -> str:
        """``<run>`` for the first seed, ``<run>-s<k>`` for seed k (also the run directory's name)."""
        return run if seed_index == 0 else f"{run}-s{seed_index}"

    def run_dir(self, run: str, seed_index: int = 0) -> Path:
        return Path(self.work_dir) / self.run_id(run, seed_index)

    def jobs(self) -> list[tuple[str, int]]:
        """Every ``(run, seed_index)``, seed by seed: an interrupted comparison has whole seeds done first."""
        return [(run, k) for k in range(self.seeds) for run in self.runs]

    def analysis_settings(self) -> dict[str, Any]:
        """The settings besides the experiment that a finished run's record and analysis depend on."""
        return {
            "eval_limit": self.eval_limit,
            "spec_tokens": self.spec_tokens,
            "warmup_rows": self.warmup_rows,
            "domain_tokens": self.domain_tokens,
            "bootstrap_iters": self.bootstrap_iters,
            "per_question": True,
        }


# ------------------------------------------------------------------------------------------------ one run
def _heldout_documents(heldout_path: Path, tokenizer) -> list[tuple[list[int], str]]:
    from repro.data.pile import iter_pile_documents

    return [(tokenizer.tokenize(d.text) + [tokenizer.eod], d.domain) for d in iter_pile_documents([heldout_path])]


def heldout_domain_losses(
    logits: Callable[[torch.Tensor], torch.Tensor],
    documents: Sequence[tuple[list[int], str]],
    seq_length: int,
    tokens_per_domain: int,
) -> tuple[DomainLoss, ...]:
    """Next-token LM loss per domain on held-out documents (module docstring, decision 2).

    Each document is cut into windows of ``seq_length`` tokens, one forward per window (batch 1); a window of n
    tokens scores its n - 1 next tokens. A domain's documents are read in order until ``tokens_per_domain``
    tokens are scored (the last window is kept whole).

    Args:
        logits: next-token logits ``[1, S, V]`` for token ids ``[1, S]`` (the model in eval mode).
        documents: ``(token_ids, domain)`` pairs.
        seq_length: window length.
        tokens_per_domain: scored tokens per domain to stop at.

    Returns:
        One :class:`~repro.report.record.DomainLoss` per domain with a window of two tokens or more, sorted by
        domain.
    """
    import torch

    from repro.report.record import DomainLoss

    total: dict[str, float] = {}
    scored: dict[str, int] = {}
    with torch.no_grad():
        for ids, domain in documents:
            for start in range(0, len(ids), seq_length):
                if scored.get(domain, 0) >= tokens_per_domain:
                    break
                window_S = torch.tensor(ids[start : start + seq_length], dtype=torch.long)
                if window_S.numel() < 2:
                    continue
                logits_SV = logits(window_S[None])[0].double()
                nll = torch.nn.functional.cross_entropy(logits_SV[:-1], window_S[1:], reduction="sum")
                total[domain] = total.get(domain, 0.0) + float(nll)
                scored[domain] = scored.get(domain, 0) + window_S.numel() - 1
    return tuple(DomainLoss(d, total[d] / scored[d], scored[d]) for d in sorted(scored))


def _analyse(cfg: MiniConfig, run: str, scorer, docs: list[tuple[list[int], str]]) -> dict[str, Any]:
    """Expert specialisation by domain and, for routers with a Dirichlet posterior, the sparsity knob."""
    import torch

    from repro.analysis import expert_specialisation, has_sparsity_knob, sparsity_knob, trace_routers
    from routers import routers_in

    analysis: dict[str, Any] = {"run": run, "settings": cfg.analysis_settings()}
    layer_routers = routers_in(scorer.model)
    if not layer_routers:
        return analysis
    analysis["specialisation"] = expert_specialisation(scorer.logits, scorer.model, docs, scorer.max_length, cfg.spec_tokens)
    if has_sparsity_knob(layer_routers[0]):
        window = [t for ids, _ in docs[:8] for t in ids][: scorer.max_length]
        with trace_routers(scorer.model, keep_inputs=True) as trace:
            scorer.logits(torch.tensor([window]))
        # 0.3 .. 1000: below ~0.3 the smallest concentrations (~1e-3) underflow the Gamma draws to 0.
        lambdas = [10 ** (e / 4) for e in range(-2, 13)]
        analysis["sparsity_knob"] = sparsity_knob(layer_routers[0], trace.inputs[0][0], lambdas)
        analysis["num_experts"] = layer_routers[0].num_experts
    return analysis


def run_one(cfg: MiniConfig, run: str, tasks_dir: Path, seed_index: int = 0) -> Path:
    """Train, evaluate, analyse and record one run (called in a worker process).

    Args:
        cfg: the comparison's settings.
        run: ``dense`` or a router name.
        tasks_dir: the local lm-eval tasks.
        seed_index: which of the comparison's seeds (0: the experiment's own seed; see :meth:`MiniConfig.experiment`).

    Returns:
        The run's record path.
    """
    import torch

    from repro.data.minipile import build_mini_pile
    from repro.evaluation.harness import SuiteLM
    from repro.evaluation.runner import evaluate_lm
    from repro.report.store import write_run_record
    from repro.training.inference import load_for_evaluation
    from repro.training.trainer import train

    torch.set_num_threads(1)
    run_dir = cfg.run_dir(run, seed_index)
    train(cfg.experiment(run, seed_index), run_dir, progress=False)
    scorer, tokenizer = load_for_evaluation(run_dir, device="cpu")
    # Batch 1: Expert Choice (and capacity dropping) couple the tokens of a batch; scoring each request
    # alone keeps every router's numbers independent of how lm-eval groups requests.
    lm = SuiteLM(model=scorer, tokenizer=tokenizer, batch_size=1)
    # log_samples: the record keeps each question's correctness, for paired tests over the same questions.
    results = evaluate_lm(
        lm, local_tasks=tasks_dir, limit=cfg.eval_limit, bootstrap_iters=cfg.bootstrap_iters, log_samples=True
    )
    docs = _heldout_documents(build_mini_pile(cfg.data_dir).heldout_path, tokenizer)
    losses = heldout_domain_losses(scorer.logits, docs, scorer.max_length, cfg.domain_tokens)
    write_json_atomic(run_dir / "analysis.json", _analyse(cfg, cfg.run_id(run, seed_index), scorer, docs))
    return write_run_record(
        run_dir, warmup=cfg.warmup_rows, lm_eval_results=results, run_id=cfg.run_id(run, seed_index),
        domain_losses=losses,
    )


def _worker_init() -> None:
    """Each worker computes on one thread (two workers share the two cores), stays offline, and lets lm-eval
    bootstrap in-process (its default is a pool of every core per bootstrapped metric)."""
    from repro.evaluation.offline import ensure_offline

    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DISABLE_MULTIPROC="1")
    ensure_offline()


def _job(item: str | tuple[str, int]) -> tuple[str, int]:
    """A job of :func:`run_all`: a run name (its first seed) or ``(run, seed_index)``."""
    return (item, 0) if isinstance(item, str) else (item[0], int(item[1]))


def run_one_timed(cfg: MiniConfig, run: str, tasks_dir: Path, seed_index: int = 0) -> None:
    """:func:`run_one`, then its wall time and the worker's CPU time (seconds) in the run's ``timing.json``. The
    worker is a fresh process per run, so its CPU time is the run's whole cost (imports included) whatever else
    the machine runs."""
    import resource

    start = time.perf_counter()
    run_one(cfg, run, tasks_dir, seed_index)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    write_json_atomic(cfg.run_dir(run, seed_index) / "timing.json",
                      {"wall_seconds": time.perf_counter() - start, "cpu_seconds": usage.ru_utime + usage.ru_stime})


def _run_logged(task: Callable[..., Any], name: str, args: tuple, log_path: Path) -> tuple[str, float]:
    """``task(*args)`` with the worker's output (megatron's warnings, progress) in ``log_path`` (never written
    through a symbolic link that leaves its directory)."""
    from repro.io_utils import open_in_dir

    start = time.perf_counter()
    with open_in_dir(log_path.parent, log_path.name, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            task(*args)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            raise
    return name, time.perf_counter() - start


def run_pool(task: Callable[..., Any], jobs: Mapping[str, tuple], *, workers: int, log_dir: Path) -> dict[str, float]:
    """Run ``task(*args)`` for every job in a pool of ``workers`` worker processes, one fresh process per job.

    Args:
        task: a module-level function (pickled by reference into the workers).
        jobs: job name -> the arguments of its call; the worker's output goes to ``log_dir/<name>.worker.log``.
        workers: jobs run at once (each one process computing on one thread).
        log_dir: where the workers' logs go.

    Returns:
        Job name -> wall seconds of the jobs that finished.

    Raises:
        ReproError: naming the jobs that failed and their logs (after every job has ended).
    """
    from tqdm import tqdm

    failed, seconds = [], {}
    # A fresh interpreter per run (spawn, one task per child): no state shared between runs or with this one.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_worker_init, max_tasks_per_child=1
    ) as pool, tqdm(
        total=len(jobs), desc="runs", unit="run"
    ) as bar:
        futures = {
            pool.submit(_run_logged, task, name, args, Path(log_dir) / f"{name}.worker.log"): name
            for name, args in jobs.items()
        }
        for future in as_completed(futures):
            run = futures[future]
            bar.update(1)
            try:
                _, seconds[run] = future.result()
                bar.write(f"  {run}: done in {seconds[run]:.0f} s")
            except Exception as exc:  # noqa: BLE001 - reported per run, with its log
                bar.write(f"  {run}: FAILED ({type(exc).__name__}: {exc})")
                failed.append(run)
    if failed:
        logs = ", ".join(str(Path(log_dir) / f"{r}.worker.log") for r in failed)
        raise ReproError(f"run(s) {', '.join(failed)} failed; see {logs}")
    return seconds


def _prepare_run_dir(cfg: MiniConfig, run: str, seed_index: int = 0) -> None:
    """Replace a stale run directory this command created; refuse one it did not create."""
    claim_run_dir(cfg.run_dir(run, seed_index), marker=RUN_MARKER, owner="the mini comparison",
                  command="python -m repro mini")


def _record_is_current(cfg: MiniConfig, run: str, seed_index: int = 0) -> bool:
    """Whether the run directory holds this command's finished run with the current settings (a directory
    this command did not create is never reused; :func:`run_all` refuses it)."""
    run_dir = cfg.run_dir(run, seed_index)
    files = (RUN_MARKER, "record.json", "analysis.json")
    if not all((run_dir / name).is_file() for name in files):
        return False
    try:
        stored = json.loads((run_dir / "config.json").read_text())["experiment"]
        settings = json.loads((run_dir / "analysis.json").read_text()).get("settings")
    except (OSError, ValueError, KeyError):
        return False
    current = RunConfig.stored_dict(stored) == cfg.experiment(run, seed_index).to_dict()
    return current and settings == cfg.analysis_settings()


def run_all(cfg: MiniConfig, runs: Sequence[str | tuple[str, int]], tasks_dir: Path) -> None:
    """Run ``runs`` in a pool of ``cfg.workers`` worker processes.

    Args:
        cfg: the comparison's settings.
        runs: run names (their first seed) or ``(run, seed_index)`` pairs.
        tasks_dir: the local lm-eval tasks.

    Raises:
        ReproError: naming the runs that failed and their logs.
    """
    jobs = [_job(item) for item in runs]
    # Every directory checked before any is replaced: a foreign one stops the command with nothing touched.
    foreign = [d for d in (cfg.run_dir(run, k) for run, k in jobs) if d.exists() and not (d / RUN_MARKER).is_file()]
    if foreign:
        raise ReproError(
            f"{foreign[0]}: exists and was not created by the mini comparison; move it away or choose another "
            f"--work-dir{f' ({len(foreign) - 1} more)' if len(foreign) > 1 else ''}"
        )
    for run, k in jobs:
        _prepare_run_dir(cfg, run, k)
    jobs = longest_first(jobs, _previous_cpu_seconds(cfg))
    run_pool(run_one_timed, {cfg.run_id(run, k): (cfg, run, tasks_dir, k) for run, k in jobs},
             workers=cfg.workers, log_dir=Path(cfg.work_dir))


def _previous_cpu_seconds(cfg: MiniConfig) -> dict[str, float]:
    """run name -> its CPU seconds in the last comparison written to ``cfg.out_dir`` (its ``summary.json``; a
    fresh clone has the published one), or nothing where there is none."""
    try:
        seconds = json.loads((Path(cfg.out_dir) / "summary.json").read_text())["run_cpu_seconds"]
        return {str(run): float(value) for run, value in seconds.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def longest_first(jobs: Sequence[tuple[str, int]], cpu_seconds: Mapping[str, float]) -> list[tuple[str, int]]:
    """The jobs of each seed (seeds still in order) longest first, by a previous run's CPU seconds.

    The pool starts jobs in this order on its free workers: the last job to start is then a short one, so
    the workers finish close together (a greedy longest-first schedule) instead of one of them training a
    long run alone at the end. A run without a figure counts as the longest; ties keep the given order. The
    order changes no run's result (each run is its own process with its own seed).

    Args:
        jobs: ``(run, seed_index)`` pairs.
        cpu_seconds: run name (first seed) -> CPU seconds.

    Returns:
        The same pairs, reordered.
    """
    return sorted(jobs, key=lambda job: (job[1], -cpu_seconds.get(job[0], math.inf)))


# -------------------------------------------------------------------------------------------- reporting
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


def _plots(cfg: MiniConfig, logs: dict[str, list], analyses: dict[str, dict], unigram: float) -> dict[str, dict]:
    from repro.report.plots import (
        plot_loss_curves,
        plot_routing_over_training,
        plot_sparsity_knob,
        plot_specialisation,
    )

    out = Path(cfg.out_dir)
    plot_loss_curves(logs, out / "loss_curves.png", unigram_loss=unigram)
    plot_routing_over_training({r: rows for r, rows in logs.items() if r != DENSE}, out / "routing_over_training.png")
    specs = {r: a["specialisation"] for r, a in analyses.items() if "specialisation" in a}
    first, second = cfg.pair
    plot_specialisation({r: specs[r] for r in cfg.pair if r in specs}, out / f"specialisation_{first}_vs_{second}.png")
    plot_specialisation(specs, out / "specialisation_all.png")
    for run, analysis in analyses.items():
        if "sparsity_knob" in analysis:
            plot_sparsity_knob(analysis["sparsity_knob"], out / f"{run}_sparsity_knob.png", analysis["num_experts"])
    return specs


def _final_loss(rows: list) -> float:
    """Mean training LM loss of the last 10 logged steps."""
    tail = rows[-10:]
    return sum(r.lm_loss for r in tail) / len(tail)


def _run_cpu_seconds(cfg: MiniConfig) -> dict[str, float]:
    """run id -> the CPU seconds of the worker that trained it (from its ``timing.json``, where there is one)."""
    out = {}
    for run, k in cfg.jobs():
        try:
            out[cfg.run_id(run, k)] = round(json.loads((cfg.run_dir(run, k) / "timing.json").read_text())["cpu_seconds"], 1)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def report(cfg: MiniConfig, unigram: float, elapsed: float, trained: Sequence[str] | None = None) -> str:
    """Write the tables, plots and ``summary.json`` of the comparison; return the text to print.

    ``elapsed`` is this invocation's wall time and ``trained`` the run ids it trained (the others were
    reused); each run's own cost is its worker's CPU time (``run_cpu_seconds``).

    The zero-shot, efficiency, routing and validation tables show the first seed's runs (exactly the
    single-seed comparison); with several seeds, the tables over seeds (``*_seeds``) follow.
    """
    from repro.io_utils import claim_output_dir
    from repro.report.plots import specialisation_score
    from repro.report.seed_tables import compare_over_seeds, record_seed, seed_zero_shot_table
    from repro.report.store import load_record
    from repro.report.table_core import render, write_tables
    from repro.report.tables import (
        efficiency_table,
        heldout_loss,
        routing_seed_table,
        routing_table,
        validation_seed_table,
        validation_table,
        zero_shot_table,
    )
    from repro.training.log import read_rows

    claim_output_dir(cfg.out_dir, OUT_MARKER, COMMAND)
    records = {job: load_record(cfg.run_dir(*job) / "record.json") for job in cfg.jobs()}
    first = [records[(run, 0)] for run in cfg.runs]
    tables = [zero_shot_table(first), efficiency_table(first), routing_table(first), validation_table(first)]
    if cfg.seeds > 1:
        every = list(records.values())
        tables += [
            seed_zero_shot_table(compare_over_seeds(every)),  # records carry their per-question results
            validation_seed_table(every),
            routing_seed_table(every),
        ]
    write_tables(tables, cfg.out_dir)
    logs = {run: read_rows(cfg.run_dir(run)) for run in cfg.runs}
    analyses = {run: json.loads((cfg.run_dir(run) / "analysis.json").read_text()) for run in cfg.runs}
    specs = _plots(cfg, logs, analyses, unigram)

    final = {run: _final_loss(rows) for run, rows in logs.items()}
    val = {run: next((r.val_loss for r in reversed(rows) if r.val_loss is not None), math.nan) for run, rows in logs.items()}
    summary = {
        "steps": cfg.steps,
        "seeds": cfg.seeds,
        "wall_seconds": round(elapsed, 1),
        "trained_runs": None if trained is None else list(trained),
        "unigram_loss": unigram,
        "final_train_lm_loss_last10": final,
        "validation_loss": val,
        # Keyed by run name, like the fields above: a router's variant is a run of the same router.
        "heldout_loss": {run: heldout_loss(records[(run, 0)]) for run in cfg.runs},
        "heldout_loss_by_domain": {run: {d.domain: d.loss for d in records[(run, 0)].domain_losses} for run in cfg.runs},
        "specialisation_score": {r: specialisation_score(s) for r, s in specs.items()},
        # Each run's worker CPU time (written when the run was trained; reused runs keep theirs).
        "run_cpu_seconds": _run_cpu_seconds(cfg),
        "command": "nox -s mini  (python -m repro mini)" + (f" --seeds {cfg.seeds}" if cfg.seeds > 1 else ""),
    }
    if cfg.seeds > 1:
        summary["per_seed"] = {
            run: {
                "seed": [record_seed(records[(run, k)]) for k in range(cfg.seeds)],
                "final_train_lm_loss_last10": [_final_loss(read_rows(cfg.run_dir(run, k))) for k in range(cfg.seeds)],
                "validation_loss": [records[(run, k)].validation_loss for k in range(cfg.seeds)],
                "heldout_loss": [heldout_loss(records[(run, k)]) for k in range(cfg.seeds)],
            }
            for run in cfg.runs
        }
    write_json_atomic(Path(cfg.out_dir) / "summary.json", summary)
    lines = [render(t, "md") for t in tables]
    lines.append(f"Unigram baseline loss: {unigram:.3f} nats/token. Final training LM loss (mean of last 10 steps):")
    lines.append("  " + ", ".join(f"{r} {final[r]:.3f}" for r in cfg.runs))
    lines.append("Specialisation score (0 = domains routed alike; 1 = disjoint experts): " + ", ".join(
        f"{r} {v:.3f}" for r, v in summary["specialisation_score"].items()
    ))
    seeds = f" ({cfg.seeds} seeds; per-run tables: the first seed)" if cfg.seeds > 1 else ""
    lines.append(f"Tables and plots in {cfg.out_dir}/{seeds}; wall time {elapsed / 60:.1f} min.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main
def parse(argv: list[str], prog: str) -> tuple[MiniConfig, bool]:
    """The comparison's settings from the command line, checked before any work; and ``--fresh``."""
    from repro.training.experiments import experiment_routers

    # Dense, every router, and the routers' declared variants (DirMoE's centred target), labelled as such.
    every = tuple(r for r in experiment_routers(variants=True) if r not in (DENSE, MEGATRON_ROUTER))
    every = (DENSE, *every)
    defaults = MiniConfig(runs=every)
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="all", help=f"comma-separated dense and router names, or all ({', '.join(every)})")
    p.add_argument("--steps", type=int, default=defaults.steps, help="training steps per run")
    p.add_argument("--workers", type=int, default=defaults.workers, help="runs trained at once")
    p.add_argument("--eval-limit", type=int, default=defaults.eval_limit, help="documents per local task")
    p.add_argument(
        "--seeds", type=int, default=defaults.seeds,
        help="runs per router with seeds seed, seed+1, ...: adds tables over seeds (mean +- 95%% CI, paired tests "
        "against switch)",
    )
    p.add_argument("--data-dir", default=defaults.data_dir)
    p.add_argument("--work-dir", default=defaults.work_dir)
    p.add_argument("--out", default=defaults.out_dir, help="tables and plots")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
    p.add_argument("--fresh", action="store_true", help="retrain every run even if its record is current")
    args = p.parse_args(argv)
    runs = every if args.runs == "all" else tuple(r.strip() for r in args.runs.split(",") if r.strip())
    unknown = [r for r in runs if r not in every]
    if unknown or not runs:
        raise ReproError(f"--runs: unknown run(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(every)}")
    for name, value in (
        ("--steps", args.steps), ("--workers", args.workers), ("--eval-limit", args.eval_limit), ("--seeds", args.seeds)
    ):
        if value < 1:
            raise ReproError(f"{name} must be >= 1, got {value}")
    cfg = MiniConfig(
        runs=runs, steps=args.steps, data_dir=args.data_dir, work_dir=args.work_dir, out_dir=args.out,
        workers=args.workers, eval_limit=args.eval_limit, overrides=tuple(args.set), seeds=args.seeds,
    )
    for run, k in cfg.jobs():
        cfg.experiment(run, k)  # unknown keys / bad values: one-line error before any work
    return cfg, args.fresh


def main(argv: list[str], prog: str = "python -m repro mini") -> int:
    """Run the comparison. Returns the exit status."""
    cfg, fresh = parse(argv, prog)
    from repro.data.minipile import build_mini_pile
    from repro.evaluation.local_tasks import build_local_tasks
    from repro.io_utils import check_output_dir

    check_output_dir(cfg.out_dir, OUT_MARKER, COMMAND)  # before any work: another command's results stay

    start = time.perf_counter()
    mini = build_mini_pile(cfg.data_dir, log=print)
    tasks_dir = build_local_tasks(mini.heldout_path, Path(cfg.work_dir) / "tasks")
    todo = [job for job in cfg.jobs() if fresh or not _record_is_current(cfg, *job)]
    reused = [cfg.run_id(*job) for job in cfg.jobs() if job not in todo]
    if reused:
        print(f"reusing finished runs: {', '.join(reused)}")
    print(f"training {len(todo)} runs x {cfg.steps} steps, {cfg.workers} at a time (logs in {cfg.work_dir}/<run>.worker.log)")
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    if todo:
        run_all(cfg, todo, tasks_dir)
    trained = [cfg.run_id(*job) for job in todo]
    print(report(cfg, _unigram_loss(mini.train_prefix), time.perf_counter() - start, trained))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
