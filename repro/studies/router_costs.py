"""``python -m repro study router-costs``: what one router call asks of the device, counted on any machine.

Every registered router (and DirMoE eager and compiled) routes T tokens of D to E experts in training mode on a
non-logging step, fp32 on CPU; after two warm-up calls, one forward and backward are counted by
:class:`repro.records.op_counts.OpCounter` (ops, regions, kernels, launches, host syncs, bytes moved). Counts are
machine-independent except compiled kernels (inductor's CPU backend fuses differently from Triton). One table,
as Markdown, CSV and JSON (``results/bench/router_costs.*``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

T, D, E, K = 1024, 128, 8, 1
SEQ_SHAPE = (1024, 1)  # one sequence of T tokens (megatron's [s, b])
VOCAB = 50304
#: Where the report goes unless --out says otherwise: never results/ (the committed tables) by default.
DEFAULT_OUT = "runs/bench"
NAME = "router_costs"
#: The write-up of the directory the benchmarks and this study fill (:mod:`repro.studies.bench_writeup`).
WRITEUPS = {"bench": "repro.studies.bench_writeup:bench"}
#: Runs beside every router at its defaults (DirMoE's CPU default is eager): label -> (router, options).
EXTRA_RUNS = {"dirmoe (compiled)": ("dirmoe", {"compile_elementwise": "always"})}
COLUMNS = (
    "router", "pass", "aten ops", "outside regions", "of which views", "regions", "kernels in regions", "launches",
    "x switch", "host syncs", "MB moved",
)


def runs() -> dict[str, tuple[str, dict[str, Any]]]:
    """The runs of the report: every registered router at its defaults, then :data:`EXTRA_RUNS`."""
    import routers

    return {name: (name, {}) for name in routers.available_routers()} | dict(EXTRA_RUNS)


def profile_router(name: str, options: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Count one forward and one backward of router ``name`` with ``options`` (``compile_elementwise`` for DirMoE)
    on a non-logging training step, weights and inputs drawn from ``seed``. Returns ``{"forward": OpCounts,
    "backward": OpCounts}``."""
    import torch

    import routers
    from repro.records.op_counts import OpCounter

    torch.manual_seed(seed)
    router = routers.build_router(name, hidden_size=D, num_experts=E, top_k=K, **options).train()
    router.collect_metrics = False  # a step that does not log
    hidden_TD = torch.randn(T, D, requires_grad=True)
    token_ids_T = torch.randint(0, VOCAB, (T,))
    signal_TE = torch.randn(T, E)  # stands in for the gradient the experts' outputs send back

    def call(counters=None):
        with counters[0] if counters else contextlib.nullcontext():
            out = router(hidden_TD, token_ids_T, SEQ_SHAPE)
        tensors = [t for t in (out.probs, *out.aux_losses.values()) if t.requires_grad]
        grads = [signal_TE if t is out.probs else torch.ones_like(t) for t in tensors]
        with counters[1] if counters else contextlib.nullcontext():
            if tensors:
                torch.autograd.backward(tensors, grads)

    for _ in range(2):  # warm-up: compilation and lazily built state
        call()
    counters = (OpCounter(), OpCounter())
    call(counters)
    return {"forward": counters[0].counts, "backward": counters[1].counts}


def build(selected: dict[str, tuple[str, dict[str, Any]]] | None = None) -> tuple[list[dict[str, Any]], Any]:
    """Profile the runs ``selected`` (label -> (router, options); default :func:`runs`) and build the table.
    Returns ``(rows, table)``: a JSON-ready dict per (run, pass), and the table."""
    from repro.report.table_core import Table

    selected = runs() if selected is None else selected
    rows: list[dict[str, Any]] = []
    for label, (name, options) in selected.items():
        counts = profile_router(name, options)
        total = {key: getattr(counts["forward"], key) + getattr(counts["backward"], key)
                 for key in ("dispatched", "outside", "views", "regions", "region_kernels", "syncs", "bytes_moved")}
        for part, values in (("fwd", vars(counts["forward"])), ("bwd", vars(counts["backward"])), ("fwd+bwd", total)):
            row = {"router": label, "pass": part, **{k: v for k, v in values.items() if not k.endswith("_ops")}}
            row["launches"] = row["outside"] + row["region_kernels"]
            if part != "fwd+bwd":
                row["sync_ops"] = dict(values["sync_ops"])
            rows.append(row)
    switch = {r["pass"]: r["launches"] for r in rows if r["router"] == "switch"}
    for row in rows:
        row["x_switch"] = row["launches"] / switch[row["pass"]] if switch.get(row["pass"]) else None
    cells = tuple(
        (r["router"], r["pass"], str(r["dispatched"]), str(r["outside"]), str(r["views"]), str(r["regions"]),
         str(r["region_kernels"]), str(r["launches"]), "--" if r["x_switch"] is None else f"{r['x_switch']:.2f}",
         str(r["syncs"]), f"{r['bytes_moved'] / 1e6:.2f}")
        for r in rows
    )
    caption = (
        "Every registered router at its defaults (DirMoE eager, its CPU default) and DirMoE compiled. "
        f"Per router call on a non-logging training step (collect_metrics=False), T={T}, D={D}, E={E}, k={K}, "
        "fp32: ATen ops dispatched, ops outside compiled regions (views among them: no kernel on a GPU), compiled "
        "regions entered, the kernels they ran (inductor's generated kernels and the extern ops they call), "
        "launches = outside + kernels in regions (the proxy for GPU kernel launches), its ratio to Switch's, host "
        "synchronisations, and estimated MB moved (inputs + outputs of each non-view op outside "
        "a region and of each region). After two warm-up calls at the same step: DirMoE's eager schedule values "
        "are computed once per step and layer, so its first micro-batch of a step costs more than these. "
        "Counted by python -m repro study router-costs; hardware-independent, but a region compiled here has "
        "inductor's C++ kernels, which fuse more than its GPU (Triton) kernels, so a compiled row counts fewer "
        "launches than a GPU makes (measured against an H100 trace: docs/efficiency.md)."
    )
    return rows, Table(name=NAME, caption=caption, headers=COLUMNS, rows=cells)


def main(argv: list[str], prog: str = "python -m repro study router-costs") -> int:
    """Profile every router and write ``router_costs.{md,csv,json}``. Returns the exit status."""
    from repro.io_utils import atomic_path, write_json_atomic
    from repro.report.table_core import render
    from repro.studies.engine import OneLineParser, pick

    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default=None, help="comma-separated run labels (default: all)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    selected = runs()
    rows, table = build({r: selected[r] for r in pick(args.router or "all", tuple(selected), "--router", "run")})
    out = Path(args.out)
    for fmt, header in (("md", f"<!-- generated by `{prog}`; do not edit -->\n\n"), ("csv", "")):
        with atomic_path(out / f"{NAME}.{fmt}") as tmp:
            tmp.write_text(header + render(table, fmt))
        print(f"wrote {out / f'{NAME}.{fmt}'}")
    write_json_atomic(out / f"{NAME}.json", {"shape": {"T": T, "D": D, "E": E, "k": K}, "rows": rows})
    print(f"wrote {out / f'{NAME}.json'}\n\n" + render(table, "md"))
    return 0
