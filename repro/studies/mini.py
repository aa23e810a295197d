"""``python -m repro study mini``: the whole router comparison on the embedded default (CPU).

A study (:mod:`repro.studies.engine`; what it runs and writes: docs/experiments.md, docs/evaluation.md). Its decisions:

Seeds (decision 1): seed k is the experiment's seed plus k, seed 0 exactly the single-seed run, so ``--seeds 1``
reproduces the committed results and adding seeds reuses finished runs. The seed drives initialisation, router
noise and megatron's data order; Mersenne Twister seeding makes consecutive seeds unrelated streams.

Held-out loss per domain (decision 2): the same held-out tokens for every router and seed, so differences are
paired, one window per forward (routers coupling a batch's tokens see one window, as in lm-eval); a per-domain
breakdown of the trainer's validation loss would leave few tokens per domain and a different mix per seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from repro.config import MEGATRON_ROUTER
from repro.io_utils import read_json, write_json_atomic
from repro.schema import check_minimums
from repro.studies.engine import CpuStudySettings, Run, Study, check_flags, pick, run_cost, run_study

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from repro.records.run_record import DomainLoss, RunRecord
    from repro.report.seed_tables import SeedComparison

COMMAND = "python -m repro study mini"
DENSE = "dense"
#: Results directory -> its write-up (``python -m repro report writeup``; :mod:`repro.studies.mini_writeup`).
WRITEUPS = {"mini": "repro.studies.mini_writeup:mini", "mini-seeds": "repro.studies.mini_writeup:mini_seeds",
            "mini-power": "repro.studies.mini_writeup:mini_seeds"}


@dataclass(frozen=True, kw_only=True)
class MiniConfig(CpuStudySettings):
    """Comparison settings beyond :class:`~repro.studies.engine.CpuStudySettings` (same ``steps`` for every
    run: compute parity at the nominal k).

    Args:
        runs: ``dense`` or router names, each the ``<run>-tiny`` experiment.
        backend: every run's model backend (docs/efficiency.md, "Model backends"); ``torch`` (SDPA) is faster
            on CPU than megatron's local spec.
        eval_limit: documents per local task (lm-eval's ``limit``; above every task's size).
        spec_tokens: held-out tokens per domain for the specialisation analysis.
        warmup_rows: log rows skipped before the efficiency window.
        pair: the two routers of the side-by-side specialisation plot (the DirMoE paper's figure).
        seeds: runs per router (decision 1).
        domain_tokens: held-out tokens scored per domain (decision 2).
        bootstrap_iters: lm-eval's ``bootstrap_iters``; > 0 turns its standard errors on.
    """

    runs: tuple[str, ...]
    work_dir: str = "runs/mini"
    out_dir: str = "runs/mini-results"
    backend: str = "torch"
    eval_limit: int = 300
    spec_tokens: int = 4096
    warmup_rows: int = 2
    pair: tuple[str, str] = ("dirmoe", "switch")
    seeds: int = 1
    domain_tokens: int = 8192
    bootstrap_iters: int = 1000

    def __post_init__(self) -> None:
        super().__post_init__()
        check_minimums(self, eval_limit=1, spec_tokens=1, seeds=1, domain_tokens=1, warmup_rows=0, bootstrap_iters=0)

    def run(self, run: str, seed_index: int = 0) -> Run:
        """``<run>-tiny`` with this comparison's settings and seed ``seed + seed_index``."""
        common = (*self.run_overrides(), f"model.backend={self.backend}", *self.overrides)
        if seed_index:  # seed 0 gets no override: the single-seed run, reused as is
            common = (*common, f"seed={Run('', f'{run}-tiny', common).config().seed + seed_index}")
        return Run(self.run_id(run, seed_index), f"{run}-tiny", common, label=run, wave=seed_index)

    def run_id(self, run: str, seed_index: int = 0) -> str:
        """``<run>`` for the first seed, ``<run>-s<k>`` for seed k (also the run directory's name)."""
        return run if seed_index == 0 else f"{run}-s{seed_index}"

    def jobs(self) -> list[tuple[str, int]]:
        """Every ``(run, seed_index)``, seed by seed (an interrupted comparison has whole seeds done)."""
        return [(run, k) for k in range(self.seeds) for run in self.runs]

    def study(self) -> Study:
        """The comparison as a :class:`~repro.studies.engine.Study`."""
        return Study("mini", tuple(self.run(r, k) for r, k in self.jobs()), self.work_dir, self.out_dir, task=run_one,
                     report=report, workers=self.workers, finished=("record.json", "analysis.json"), current=_current,
                     settings=self, owner="the mini comparison")

    def analysis_settings(self) -> dict[str, Any]:
        """Non-experiment settings a finished run's record and analysis depend on."""
        keys = ("eval_limit", "spec_tokens", "warmup_rows", "domain_tokens", "bootstrap_iters")
        return {**{key: getattr(self, key) for key in keys}, "per_question": True}


# ------------------------------------------------------------------------------------------------ one run
def heldout_domain_losses(
    logits: Callable[[torch.Tensor], torch.Tensor],
    documents: Sequence[tuple[list[int], str]],
    seq_length: int,
    tokens_per_domain: int,
) -> tuple[DomainLoss, ...]:
    """Next-token LM loss per domain on held-out documents (module docstring, decision 2).

    Windows of ``seq_length`` tokens, one forward each (batch 1); a window of n tokens scores n - 1. Documents are
    read in order until ``tokens_per_domain`` tokens are scored (the last window kept whole).

    Args:
        logits: next-token logits ``[1, S, V]`` for token ids ``[1, S]`` (model in eval mode).
        documents: ``(token_ids, domain)`` pairs.

    Returns:
        A :class:`~repro.records.run_record.DomainLoss` per domain with a window of >= 2 tokens, sorted by domain.
    """
    import torch

    from repro.records.run_record import DomainLoss

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

    def route(tokens_BS: torch.Tensor) -> None:  # a forward for the router traces alone: no logits
        scorer.logits(tokens_BS, start=tokens_BS.shape[1])

    analysis["specialisation"] = expert_specialisation(route, scorer.model, docs, scorer.max_length, cfg.spec_tokens)
    if has_sparsity_knob(layer_routers[0]):
        window = [t for ids, _ in docs[:8] for t in ids][: scorer.max_length]
        with trace_routers(scorer.model, keep_inputs=True) as trace:
            route(torch.tensor([window]))
        # 0.3 .. 1000: below ~0.3 the smallest concentrations (~1e-3) underflow the Gamma draws to 0.
        lambdas = [10 ** (e / 4) for e in range(-2, 13)]
        analysis["sparsity_knob"] = sparsity_knob(layer_routers[0], trace.inputs[0][0], lambdas)
        analysis["num_experts"] = layer_routers[0].num_experts
    return analysis


def run_one(study: Study, run: Run) -> Path:
    """Train, evaluate, analyse and record one run (the study's task, in a worker).

    Returns:
        The record path.
    """
    from repro.data.minipile import open_mini_pile
    from repro.data.pile import iter_pile_documents
    from repro.evaluation.harness import SuiteLM
    from repro.evaluation.runner import evaluate_lm
    from repro.records.store import write_run_record
    from repro.training.inference import load_for_evaluation
    from repro.training.trainer import train

    cfg: MiniConfig = study.settings
    run_dir = study.run_dir(run)
    train(run.config(), run_dir, progress=False)
    scorer, tokenizer = load_for_evaluation(run_dir, device="cpu")
    # Batch 1: Expert Choice and capacity dropping couple a batch's tokens, so score requests alone.
    lm = SuiteLM(model=scorer, tokenizer=tokenizer, batch_size=1)
    # log_samples: per-question correctness, for paired tests.
    results = evaluate_lm(lm, local_tasks=Path(cfg.work_dir) / "tasks", limit=cfg.eval_limit,
                          bootstrap_iters=cfg.bootstrap_iters, log_samples=True)
    docs = [(tokenizer.tokenize(d.text) + [tokenizer.eod], d.domain)
            for d in iter_pile_documents([open_mini_pile(cfg.data_dir).heldout_path])]
    losses = heldout_domain_losses(scorer.logits, docs, scorer.max_length, cfg.domain_tokens)
    write_json_atomic(run_dir / "analysis.json", _analyse(cfg, run.run_id, scorer, docs))
    return write_run_record(run_dir, warmup=cfg.warmup_rows, lm_eval_results=results, run_id=run.run_id,
                            domain_losses=losses)


def _current(study: Study, run: Run) -> bool:
    """Whether a finished run's analysis has the current settings."""
    analysis = read_json(study.run_dir(run) / "analysis.json")
    return isinstance(analysis, dict) and analysis.get("settings") == study.settings.analysis_settings()


# -------------------------------------------------------------------------------------------- reporting
def _unigram_loss(prefix: str) -> float:
    """Cross-entropy (nats/token) of the training tokens under their own unigram distribution."""
    import numpy as np

    from repro.data.token_counts import count_tokens

    counts = count_tokens([prefix], split="1,0,0")  # every document
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _plots(cfg: MiniConfig, logs: dict[str, list], analyses: dict[str, dict], unigram: float) -> dict[str, dict]:
    from repro.report.plots import plot_loss_curves, plot_routing_over_training, plot_sparsity_knob, plot_specialisation

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


def _routing(record) -> dict[str, Any]:
    """Load imbalance (mean over MoE layers) and experts per token per layer (numbered from 1)."""
    from repro.report.tables import layer_mean

    return {"load_imbalance": layer_mean("load_imbalance")(record),
            "active_experts": {str(layer.layer + 1): layer.active_experts for layer in record.routing}}


def seed_comparisons(every: Sequence[RunRecord]) -> tuple[SeedComparison, SeedComparison]:
    """The zero-shot and routing comparisons over seeds of the runs of every seed (their tables and the summary's
    ``over_seeds`` both come from these)."""
    from repro.report.seed_tables import compare_over_seeds
    from repro.report.tables import routing_seed_comparison

    return compare_over_seeds(every), routing_seed_comparison(every)  # the records carry their per-question results


def tested(first: Sequence[RunRecord], comparisons: tuple[SeedComparison, SeedComparison] | None) -> dict[str, Any]:
    """The tables' verdicts as ``summary.json`` holds them for the write-ups: each first-seed run off compute parity
    -> its expert FLOPs per token relative to the reference run's (the efficiency table's ``NO``); with several seeds,
    the :func:`seed_comparisons` (:func:`repro.report.seed_tables.comparison_json`)."""
    from repro.report.compute_parity import compute_parity
    from repro.report.seed_tables import comparison_json, zero_shot_headers
    from repro.report.tables import ROUTING_HEADERS

    parity = compute_parity(first)
    out: dict[str, Any] = {"expert_flops_off_parity": {run: v.relative_difference for run, v in parity.items()
                                                        if v.at_parity is False}}
    if comparisons:
        zero_shot, routing = comparisons
        out["over_seeds"] = {"zero_shot": comparison_json(zero_shot, zero_shot_headers(zero_shot)),
                             "routing": comparison_json(routing, ROUTING_HEADERS)}
    return out


def _final_loss(rows: list) -> float:
    """Mean training LM loss of the last 10 logged steps."""
    tail = rows[-10:]
    return sum(r.lm_loss for r in tail) / len(tail)


def report(study: Study, outcome: dict[str, Any]) -> str:
    """Write the tables, plots and ``summary.json``; return the text to print.

    The main tables show the first seed (the single-seed comparison); with several seeds, ``*_seeds`` tables
    follow. Each run's cost is its worker's CPU time (reused runs keep theirs).
    """
    from repro.data.minipile import open_mini_pile
    from repro.records.step_log import read_rows
    from repro.records.store import load_record, write_record
    from repro.report.plots import specialisation_score
    from repro.report.seed_tables import record_seed, seed_zero_shot_table
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

    cfg: MiniConfig = study.settings
    elapsed, unigram = outcome["elapsed"], _unigram_loss(open_mini_pile(cfg.data_dir).train_prefix)
    records = {job: load_record(cfg.run_dir(*job) / "record.json") for job in cfg.jobs()}
    first = [records[(run, 0)] for run in cfg.runs]
    tables = [zero_shot_table(first), efficiency_table(first), routing_table(first), validation_table(first)]
    comparisons = seed_comparisons(list(records.values())) if cfg.seeds > 1 else None
    if comparisons:
        tables += [seed_zero_shot_table(comparisons[0]), validation_seed_table(list(records.values())),
                   routing_seed_table(comparisons[1])]
    write_tables(tables, cfg.out_dir)
    every_log = {job: read_rows(cfg.run_dir(*job)) for job in cfg.jobs()}
    logs = {run: every_log[(run, 0)] for run in cfg.runs}
    analyses = {run: json.loads((cfg.run_dir(run) / "analysis.json").read_text()) for run in cfg.runs}
    specs = _plots(cfg, logs, analyses, unigram)

    final = {run: _final_loss(rows) for run, rows in logs.items()}
    val = {run: next((r.val_loss for r in reversed(rows) if r.val_loss is not None), math.nan) for run, rows in logs.items()}
    summary = {
        "steps": cfg.steps,
        "seeds": cfg.seeds,
        "wall_seconds": round(elapsed, 1),
        "trained_runs": list(outcome["trained"]),
        "unigram_loss": unigram,
        "final_train_lm_loss_last10": final,
        "validation_loss": val,
        # Keyed by run name: a router's variant is a run of the same router.
        "heldout_loss": {run: heldout_loss(records[(run, 0)]) for run in cfg.runs},
        "heldout_loss_by_domain": {run: {d.domain: d.loss for d in records[(run, 0)].domain_losses} for run in cfg.runs},
        "specialisation_score": {r: specialisation_score(s) for r, s in specs.items()},
        "routing": {run: _routing(records[(run, 0)]) for run in cfg.runs if records[(run, 0)].routing},
        **tested(first, comparisons),
        "run_cpu_seconds": {r.run_id: round(c["cpu_seconds"], 1) for r in study.runs if (c := run_cost(study.run_dir(r)))},
        "command": "nox -s mini  (python -m repro study mini)" + (f" --seeds {cfg.seeds}" if cfg.seeds > 1 else ""),
    }
    if cfg.seeds > 1:
        summary["per_seed"] = {
            run: {
                "seed": [record_seed(records[(run, k)]) for k in range(cfg.seeds)],
                "final_train_lm_loss_last10": [_final_loss(every_log[(run, k)]) for k in range(cfg.seeds)],
                "validation_loss": [records[(run, k)].validation_loss for k in range(cfg.seeds)],
                "heldout_loss": [heldout_loss(records[(run, k)]) for k in range(cfg.seeds)],
            }
            for run in cfg.runs
        }
    write_json_atomic(Path(cfg.out_dir) / "summary.json", summary)
    if cfg.seeds > 1:  # the seed band `report check RUN --against <out>` reads (docs/evaluation.md)
        (Path(cfg.out_dir) / "records").mkdir(parents=True, exist_ok=True)
        for (run, k), record in records.items():
            write_record(record, Path(cfg.out_dir) / "records" / f"{cfg.run_id(run, k)}.record.json")
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
    """The checked settings from the command line, and ``--fresh``."""
    defaults = MiniConfig(runs=())
    p = defaults.parser(prog, __doc__.split("\n\n")[0])
    p.add_argument("--runs", default="all", help="comma-separated dense and router names (a router's declared "
                   "variants too, e.g. dirmoe+centered), or all: dense, every router and every variant")
    p.add_argument("--eval-limit", type=int, default=defaults.eval_limit, help="documents per local task")
    p.add_argument("--seeds", type=int, default=defaults.seeds, help="runs per router with seeds seed, seed+1, ...: "
                   "adds tables over seeds (mean +- 95%% CI, paired tests against switch)")
    args = p.parse_args(argv)
    # The routers (and so megatron-core) only now: --help answers at once.
    from repro.experiments import experiment_routers

    # Dense, every router, and the routers' declared variants (DirMoE's centred target), labelled as such.
    every = (DENSE, *(r for r in experiment_routers(variants=True) if r not in (DENSE, MEGATRON_ROUTER)))
    runs = pick(args.runs, every, "--runs", "run")
    check_flags(args, steps=1, workers=1, eval_limit=1, seeds=1)
    cfg = MiniConfig(runs=runs, eval_limit=args.eval_limit, seeds=args.seeds, **CpuStudySettings.shared(args))
    return cfg, args.fresh


def main(argv: list[str], prog: str = COMMAND) -> int:
    """Run the comparison. Returns the exit status."""
    cfg, fresh = parse(argv, prog)
    from repro.data.minipile import build_mini_pile
    from repro.evaluation.local_tasks import build_local_tasks

    def prepare() -> None:
        build_local_tasks(build_mini_pile(cfg.data_dir, log=print).heldout_path, Path(cfg.work_dir) / "tasks")

    run_study(cfg.study(), fresh=fresh, prepare=prepare)
    return 0

