"""Compute parity: routers picking a variable number of experts per token (ReMoE, DirMoE, Expert Choice) can spend
more or less FFN compute than their nominal k; a quality comparison is fair only when measured expert FLOPs per
token (:func:`repro.records.flops.expert_flops_per_token`) agree with a reference run's within a stated tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from repro.records.run_record import RunRecord

DEFAULT_PARITY_TOLERANCE = 0.05
DEFAULT_REFERENCE_ROUTER = "switch"


@dataclass(frozen=True)
class ParityVerdict:
    """One run's parity verdict: relative difference (run - reference) / reference of measured expert FLOPs per
    token (None: nothing to compare); ``at_parity`` None when unknown; ``note``: the efficiency table's text."""

    relative_difference: float | None
    at_parity: bool | None
    note: str


def _expert_flops(record: RunRecord) -> float | None:
    return None if record.efficiency is None else record.efficiency.expert_flops_per_token_measured


def compute_parity(
    records: Sequence[RunRecord], *, tolerance: float = DEFAULT_PARITY_TOLERANCE,
    reference_router: str = DEFAULT_REFERENCE_ROUTER,
) -> dict[str, ParityVerdict]:
    """``run_id -> ParityVerdict`` of the runs compared in one table, against a reference run: the first run of
    ``reference_router`` with a measured figure, else the first with one; ``tolerance``: the largest relative
    difference still called parity."""
    measured = [r for r in records if _expert_flops(r) is not None]
    reference = next((r for r in measured if r.experiment.router == reference_router),
                     measured[0] if measured else None)
    verdicts = {}
    for record in records:
        value = _expert_flops(record)
        if value is None or reference is None:
            verdicts[record.run_id] = ParityVerdict(None, None, "unknown (no measured k)")
            continue
        diff = (value - _expert_flops(reference)) / _expert_flops(reference)
        if record is reference:
            note = "reference"
        elif abs(diff) <= tolerance:
            note = f"yes ({diff * 100:+.1f}% vs {reference.run_id})"
        else:
            note = f"NO ({diff * 100:+.1f}% vs {reference.run_id}, tolerance {tolerance * 100:g}%)"
        verdicts[record.run_id] = ParityVerdict(diff, abs(diff) <= tolerance, note)
    return verdicts
