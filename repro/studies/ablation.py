"""``python -m repro study ablation``: why DirMoE's routing collapses on the embedded default, cell by cell, over seeds.

On the embedded default (``tiny``, mini-pile, 600 steps) DirMoE as specified sends almost every token of one
layer to one expert (docs/experiments.md, "The DirMoE ablation"). Each *cell* is one reading of the paper or one
remedy (router options, :data:`CELLS`), run over several seeds as one study (:mod:`repro.studies.engine`). Per
run: end-of-run routing and losses (mean over the last ``final_fraction`` of steps); per cell: mean +- 95%
interval over seeds and paired tests against the paper's DirMoE and Switch, Holm-adjusted over ``--family``;
with at most :data:`MAX_PAIRED_CELLS` DirMoE cells, cell against cell (:mod:`repro.report.ablation_tables`).
No zero-shot evaluation: the question is routing, and zero-shot differences are within noise at this scale.

**Screen and confirmation.** Seeds 1-6 (:data:`SCREEN_SEEDS`) are a screen that picked cells and claims, so
their p-values are exploratory. ``--confirm`` refuses screen seeds and adds ``ablation_confirm``, testing only
the pre-stated :data:`HYPOTHESES` as one Holm family::

    python -m repro study ablation --confirm --cells paper,recon-centered,kl-off,aux-off,switch --seeds 7,8,9,10,11,12 \
        --out results/dirmoe-ablation-confirm

``--tables-only``: :func:`rebuild_tables`. The cost in ``summary.json`` is each run's worker CPU time, not wall
time (distorted on a shared machine).

Choices (each with its reason):

1. **600 steps**, as the users' findings and ``nox -s mini``: a shorter run compresses every DirMoE schedule
   (they span the run) and changes the question. Cost: results/dirmoe-ablation/README.md.
2. **End-of-run window** (last tenth of the steps) for routing metrics and LM loss, the same for every cell:
   per-step load imbalance is noisy, and the findings are about the end state.
3. **Validation on 8 micro-batches** (recipe: 2): validation loss is compared across cells, and 2 micro-batches
   are noisier than the differences looked for.
4. **Checkpoints every 200 steps**: bounds the loss from a killed run while keeping disk use modest over all runs.
5. **dense-first** dispatches densely for the first sixth of the run: the users saw the shared component take
   over the router input by step 100.
6. **Weight imbalance** (``max_i mean_t r_ti / (1/E)``) beside load imbalance: under dense dispatch the load is
   flat by construction and only the weights show a collapse.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.errors import ReproError
from repro.io_utils import write_json_atomic
from repro.report import ablation_tables
from repro.report.ablation_tables import REFERENCE, SWITCH, Hypothesis
from repro.studies.engine import CpuStudySettings, Run, Study, pick, run_cost, run_study

COMMAND = "python -m repro study ablation"
#: The seeds of the screens (results/dirmoe-ablation, -6seeds): a confirmatory study must use others.
SCREEN_SEEDS = (1, 2, 3, 4, 5, 6)
#: Max DirMoE cells for the all-pairs table (a screen's pairs are for the confirmatory study to state, not scan).
MAX_PAIRED_CELLS = 6
#: Results directory -> its write-up (``python -m repro report writeup``; :mod:`repro.studies.ablation_writeup`).
WRITEUPS = {"dirmoe-ablation": "repro.studies.ablation_writeup:screen",
            "dirmoe-ablation-6seeds": "repro.studies.ablation_writeup:ablation",
            "dirmoe-ablation-confirm": "repro.studies.ablation_writeup:confirm"}


@dataclass(frozen=True)
class Cell:
    """One variant of the ablation.

    Args:
        name: ``--cells`` name.
        router: ``dirmoe`` or ``switch``.
        reading: what the cell tests, one line (tables, README).
        options: router options, ``NAME=VALUE``.
        per_run: options set from the run's length, ``(NAME, divisor)``: ``NAME = max(1, steps // divisor)``.
    """

    name: str
    router: str
    reading: str
    options: tuple[str, ...] = ()
    per_run: tuple[tuple[str, int], ...] = ()

    def router_options(self, steps: int) -> tuple[str, ...]:
        """Router options (``NAME=VALUE``) for a run of ``steps`` steps."""
        return (*self.options, *(f"{name}={max(1, steps // divisor)}" for name, divisor in self.per_run))


_CELL_LIST = (
    Cell(REFERENCE, "dirmoe", "the paper's DirMoE (default options)"),
    Cell("recon-centered", "dirmoe", "reconstruction target with the batch mean removed", ("recon_target=centered",)),
    Cell("recon-data-mean", "dirmoe", "reconstruction with a running data mean added to the decoder", ("recon_target=data_mean",)),
    Cell("recon-off", "dirmoe", "no reconstruction term", ("recon_weight=0",)),
    Cell("kl-off", "dirmoe", "no Dirichlet KL", ("kl_weight=0",)),
    Cell("sparsity-off", "dirmoe", "no sparsity penalty", ("sparsity_weight=0",)),
    Cell("aux-off", "dirmoe", "none of the three aux terms", ("recon_weight=0", "kl_weight=0", "sparsity_weight=0")),
    Cell("dispatch-topk", "dirmoe", "top-k dispatch instead of the threshold rule", ("dispatch=topk",)),
    Cell("dispatch-dense", "dirmoe", "every expert, weighted by r (the paper's y = sum_i r_i E_i(x))", ("dispatch=dense",)),
    Cell("dense-first", "dirmoe", "dense dispatch for the first sixth of the run, then the threshold rule", per_run=(("dense_steps", 6),)),
    Cell("tau-short", "dirmoe", "the 'short' temperature schedule (tau at its end after a tenth of the run)", per_run=(("tau_schedule_steps", 10),)),
    Cell("posterior-tied", "dirmoe", "posterior scale tied to the prior's (lambda_q = lambda_p)", ("posterior_scale=tied",)),
    Cell("posterior-prior-matched", "dirmoe", "prior at the posterior's scale", ("posterior_scale=prior_matched",)),
    Cell("dirmoe-balance", "dirmoe", "control: Switch's load-balancing loss on DirMoE (1e-2)", ("balance_loss_coeff=0.01",)),
    Cell("switch-no-balance", "switch", "control: Switch without its load-balancing loss", ("aux_loss_coeff=0",)),
    Cell(SWITCH, "switch", "reference level: Switch as is (balancing loss 1e-2)"),
)
#: Every cell by name, in table order.
CELLS = types.MappingProxyType({cell.name: cell for cell in _CELL_LIST})


_LEVER = "the centred target is the main lever on layer 1's collapse"
#: ``--confirm``'s pre-stated hypotheses (centred-target claims); one Holm family, two-sided paired t-tests.
HYPOTHESES = (
    Hypothesis("recon-centered", REFERENCE, "load_imbalance[0]", "the centred target lowers layer 1's load imbalance",
               "lower"),
    Hypothesis("recon-centered", REFERENCE, "load_imbalance[1]", "the centred target lowers layer 2's load imbalance",
               "lower"),
    Hypothesis("recon-centered", REFERENCE, "val_loss", "the centred target changes the validation loss"),
    Hypothesis("recon-centered", SWITCH, "val_loss", "the centred target's validation loss differs from Switch's"),
    Hypothesis("recon-centered", "kl-off", "load_imbalance[0]", f"{_LEVER}: more than removing the KL", "lower"),
    Hypothesis("recon-centered", "aux-off", "load_imbalance[0]", f"{_LEVER}: more than removing every aux term", "lower"),
)


@dataclass(frozen=True, kw_only=True)
class AblationConfig(CpuStudySettings):
    """Ablation settings beyond :class:`~repro.studies.engine.CpuStudySettings` (whose ``overrides`` follow the cell's).

    Args:
        cells: :data:`CELLS` names, in table order.
        seeds: the same for every cell, so cells pair by seed.
        final_fraction: trailing share of steps the end-of-run metrics average.
        family: Holm family against a reference cell (``table`` or ``column``, :mod:`repro.report.over_seeds`).
        confirm: confirmatory study: seeds outside :data:`SCREEN_SEEDS`, plus the ``ablation_confirm`` table.
    """

    cells: tuple[str, ...]
    seeds: tuple[int, ...] = (1, 2, 3)
    work_dir: str = "runs/dirmoe-ablation"
    out_dir: str = "runs/dirmoe-ablation-results"
    final_fraction: float = 0.1
    family: str = "table"
    confirm: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [c for c in self.cells if c not in CELLS]
        if unknown or not self.cells:
            raise ValueError(f"unknown cell(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(CELLS)}")
        if len(set(self.cells)) != len(self.cells):
            raise ValueError(f"cells must be distinct, got {', '.join(self.cells)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds must be distinct integers >= 0, got {list(self.seeds)}")
        if not 0 < self.final_fraction <= 1:
            raise ValueError(f"final_fraction must be in (0, 1], got {self.final_fraction}")
        if self.family not in ("table", "column"):
            raise ValueError(f"unknown family '{self.family}'; valid: table, column")
        reused = sorted(set(self.seeds) & set(SCREEN_SEEDS))
        if self.confirm and reused:
            raise ValueError(f"a confirmatory study needs seeds outside the screen's {list(SCREEN_SEEDS)}, got {reused}")

    @property
    def final_window(self) -> int:
        """Trailing rows the end-of-run metrics average (at least one)."""
        return max(1, round(self.steps * self.final_fraction))

    def run_id(self, cell: str, seed: int) -> str:
        """``<cell>-s<seed>`` (also the run directory's name)."""
        return f"{cell}-s{seed}"

    def jobs(self) -> list[tuple[str, int]]:
        """Every (cell, seed), cells inside seeds: a session cut short leaves every cell with the same seeds,
        and a shared machine's slow hours fall on every cell alike."""
        return [(cell, seed) for seed in self.seeds for cell in self.cells]

    def run(self, cell: str, seed: int) -> Run:
        """The run ``<cell>-s<seed>``: ``<router>-tiny`` with the ablation's settings and the cell's options."""
        overrides = (
            *self.run_overrides(), f"seed={seed}",
            "validation.iters=8",  # choice 3
            "checkpoint.interval=200",  # choice 4
            *(f"router.options.{item}" for item in CELLS[cell].router_options(self.steps)), *self.overrides,
        )
        return Run(self.run_id(cell, seed), f"{CELLS[cell].router}-tiny", overrides, label=cell,
                   name=f"ablation-{cell}")

    def study(self) -> Study:
        """The ablation as a :class:`~repro.studies.engine.Study`: killed runs resume."""
        return Study("ablation", tuple(self.run(c, s) for c, s in self.jobs()), self.work_dir, self.out_dir,
                     report=report, workers=self.workers, resume=True, finished=("summary.json", "record.json"),
                     settings=self, owner="the DirMoE ablation")


# ------------------------------------------------------------------------------------------- reporting
def _cost(cfg: AblationConfig) -> dict[str, Any]:
    """Worker CPU seconds: total, and per run of each cell."""
    costs = {(c, s): run_cost(cfg.run_dir(c, s)) for c, s in cfg.jobs()}
    known = {k: v for k, v in costs.items() if v is not None}
    per_cell = {cell: round(sum(cpu) / len(cpu), 1) for cell in cfg.cells
                if (cpu := [v["cpu_seconds"] for (c, _), v in known.items() if c == cell])}
    return {
        "runs_measured": len(known),
        "runs": len(costs),
        "cpu_seconds_measured_runs": round(sum(v["cpu_seconds"] for v in known.values()), 1),
        "cpu_seconds_per_run_by_cell": per_cell,
    }


def cell_pairs(cells: Sequence[str], confirm: bool = False) -> list[tuple[str, str]]:
    """The rows of the cell-against-cell table: every two DirMoE cells besides ``paper`` when there are 2 to
    :data:`MAX_PAIRED_CELLS` of them (else, and in a confirmatory study, none: no such table)."""
    paired = [c for c in cells if c != REFERENCE and CELLS[c].router == "dirmoe"]
    if confirm or not 2 <= len(paired) <= MAX_PAIRED_CELLS:
        return []
    return [(a, b) for i, a in enumerate(paired) for b in paired[i + 1:]]


def build_tables(results, cells: tuple[str, ...], *, family: str = "table", confirm: bool = False) -> list:
    """The tables: against ``paper``, against Switch, differences to ``paper``, cell against cell (up to
    :data:`MAX_PAIRED_CELLS`); for a confirmatory study, the pre-registered hypotheses alone."""
    if confirm:  # one family per comparison: the screen's tables would test the same cells again in other families
        return [ablation_tables.confirm_table(results, HYPOTHESES)]
    tables = [ablation_tables.ablation_table(results, reference=REFERENCE, family=family)]
    if SWITCH in cells:
        tables.append(ablation_tables.ablation_table(results, reference=SWITCH, name="ablation_vs_switch",
                                                     family=family))
    if REFERENCE in cells and len(cells) > 1:
        tables.append(ablation_tables.ablation_difference_table(results, reference=REFERENCE, family=family))
    if pairs := cell_pairs(cells):
        tables.append(ablation_tables.pairs_table(results, pairs, family=family))
    note = (" Screen: cells and claims were chosen from runs on these seeds, so these p-values are exploratory; "
            f"`{COMMAND} --confirm` tests the claims stated in advance on seeds outside {min(SCREEN_SEEDS)}-"
            f"{max(SCREEN_SEEDS)}.")
    return [dataclasses.replace(t, caption=t.caption + note) for t in tables]


def report(study: Study, outcome: dict[str, Any]) -> str:
    """Write the tables, plots and ``summary.json``; return the text to print."""
    from repro.records.step_log import read_rows
    from repro.report.plots import plot_ablation_summary, plot_expert_load, plot_shared_mean, plot_simpson_theta
    from repro.report.table_core import render, write_tables

    cfg: AblationConfig = study.settings
    out, elapsed = Path(cfg.out_dir), outcome["elapsed"]
    logs = {(c, s): read_rows(cfg.run_dir(c, s)) for c, s in cfg.jobs()}
    results = ablation_tables.collect_results(
        {cell: {seed: logs[(cell, seed)] for seed in cfg.seeds} for cell in cfg.cells},
        final_window=cfg.final_window,
        readings={cell: CELLS[cell].reading for cell in cfg.cells},
    )
    tables = build_tables(results, cfg.cells, family=cfg.family, confirm=cfg.confirm)
    write_tables(tables, out)

    first = cfg.seeds[0]
    # Dense dispatch gives every expert every token: its load is flat by construction, its weights are not.
    share = {c: "weight_share" if "dispatch=dense" in CELLS[c].options else "tokens_per_expert" for c in cfg.cells}
    plot_expert_load(
        {c: logs[(c, first)] for c in cfg.cells}, out / "expert_load.png", metric=share,
        title=f"Each expert's share of the tokens over training, seed {first}; dispatch-dense: of the weight r",
    )
    by_cell = {c: [logs[(c, s)] for s in cfg.seeds] for c in cfg.cells if CELLS[c].router == "dirmoe"}
    if by_cell:
        plot_shared_mean(by_cell, out / "shared_mean.png")
        plot_simpson_theta(by_cell, out / "simpson_theta.png")
    summary_keys = [m.key for m in results.metrics if m.key.split("[")[0] in ablation_tables.DIFFERENCE_KEYS]
    plot_ablation_summary(
        ablation_tables.summary_intervals(results, summary_keys), out / "summary.png", references=(REFERENCE, SWITCH)
    )

    summary = {
        "command": "nox -s dirmoe-ablation  (python -m repro study ablation)",
        "cells": {c: {"router": CELLS[c].router, "options": list(CELLS[c].router_options(cfg.steps)),
                      "reading": CELLS[c].reading} for c in cfg.cells},
        "seeds": list(cfg.seeds),
        "steps": cfg.steps,
        "final_window_steps": cfg.final_window,
        "overrides": list(cfg.overrides),
        "family": cfg.family,
        "confirm": cfg.confirm,
        **_hypotheses_json(cfg.confirm),
        "wall_seconds_this_invocation": round(elapsed, 1),
        "this_invocation": {k: len(outcome[k]) for k in ("trained", "resumed", "reused")},
        "cost": _cost(cfg),
        "pairs": cell_pairs(cfg.cells, cfg.confirm),
        "results": ablation_tables.results_to_json(results, reference=REFERENCE, switch=SWITCH, family=cfg.family),
    }
    write_json_atomic(out / "summary.json", summary)
    lines = [render(t, "md") for t in tables]
    lines.append(f"Tables and plots in {cfg.out_dir}/; wall time of this invocation {elapsed / 60:.1f} min.")
    return "\n".join(lines)


def _hypotheses_json(confirm: bool) -> dict[str, Any]:
    """The hypotheses a confirmatory study tested, for its summary (the write-up reads them there)."""
    return {"hypotheses": [dataclasses.asdict(h) for h in HYPOTHESES]} if confirm else {}


def rebuild_tables(out_dir: str, *, family: str = "table", confirm: bool | None = None) -> str:
    """``--tables-only``: tables and statistics recomputed from the per-seed values in ``out_dir``'s ``summary.json``,
    Holm family ``family``, with the confirmatory table if ``confirm`` (default: what the summary records); no run
    directories needed, plots untouched. Returns the tables as Markdown, to print.

    Raises:
        ReproError: not this command's output directory, or no readable ``summary.json`` there.
    """
    from repro.report.table_core import render, write_tables
    from repro.studies.engine import check_out_dir

    check_out_dir(Study("ablation", (), "", out_dir))
    path = Path(out_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
        results = ablation_tables.results_from_json(summary)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReproError(f"{path}: no ablation summary to rebuild the tables from ({exc})") from None
    unknown = [c for c in results.cells if c not in CELLS]
    if unknown:
        raise ReproError(f"{path}: unknown cell(s) {', '.join(unknown)}")
    confirm = bool(summary.get("confirm", False)) if confirm is None else confirm
    reused = sorted({s for c in results.cells for s in results.seeds(c)} & set(SCREEN_SEEDS))
    if confirm and reused:
        raise ReproError(f"{path}: runs on the screen's seeds {reused} cannot confirm what they suggested")
    tables = build_tables(results, results.cells, family=family, confirm=confirm)
    write_tables(tables, out_dir)
    summary.update(family=family, confirm=confirm, **_hypotheses_json(confirm),
                   tables_rebuilt_by=f"{COMMAND} --tables-only --out {out_dir} --family {family}"
                   + (" --confirm" if confirm else ""),
                   pairs=cell_pairs(results.cells, confirm),
                   results=ablation_tables.results_to_json(results, reference=REFERENCE, switch=SWITCH, family=family))
    write_json_atomic(path, summary)
    return "\n".join(render(t, "md") for t in tables)


# ------------------------------------------------------------------------------------------------ main
def parse(argv: list[str], prog: str) -> tuple[AblationConfig | argparse.Namespace, bool | None]:
    """The checked settings and ``--fresh``; with ``--tables-only``, the parsed arguments and None."""
    defaults = AblationConfig(cells=tuple(CELLS))
    p = defaults.parser(prog, __doc__.split("\n\n")[0])
    p.add_argument("--cells", default="all", help=f"comma-separated cells, or all ({', '.join(CELLS)})")
    p.add_argument("--seeds", default=",".join(map(str, defaults.seeds)), help="comma-separated seeds (set as seed=N)")
    p.add_argument("--family", choices=("table", "column"), default=defaults.family,
                   help="Holm family of the tests against a reference cell: the whole table (default) or each column")
    p.add_argument("--confirm", action="store_true",
                   help=f"confirmatory study: seeds outside the screen's {','.join(map(str, SCREEN_SEEDS))}, and a "
                   "table of the pre-registered hypotheses alone")
    p.add_argument("--tables-only", action="store_true",
                   help="rebuild the tables and summary statistics from <out>/summary.json; no training")
    args = p.parse_args(argv)
    if args.tables_only:
        return args, None
    cells = pick(args.cells, tuple(CELLS), "--cells", "cell")
    try:
        seeds = tuple(int(part) for part in args.seeds.split(",") if part.strip())
    except ValueError:
        raise ReproError(f"--seeds: expected comma-separated integers, got '{args.seeds}'") from None
    try:
        cfg = AblationConfig(cells=cells, seeds=seeds, family=args.family, confirm=args.confirm,
                             **CpuStudySettings.shared(args))
    except ValueError as exc:
        raise ReproError(str(exc)) from None
    return cfg, args.fresh


def main(argv: list[str], prog: str = COMMAND) -> int:
    """Run the ablation. Returns the exit status."""
    cfg, fresh = parse(argv, prog)
    if fresh is None:  # --tables-only
        print(rebuild_tables(cfg.out, family=cfg.family, confirm=cfg.confirm or None))
        return 0
    from repro.data.minipile import build_mini_pile

    run_study(cfg.study(), fresh=fresh, prepare=lambda: build_mini_pile(cfg.data_dir, log=print))
    return 0

