"""The ledger of published numbers, ``results/published/*.json`` (its README: the fields, who measured what and
the tolerances): every figure the suite compares against, one entry per number as printed in one paper's table.

Metric names are shared with the run records (:func:`repro.report.check.record_value`):
``zero_shot.<lm-eval task>`` and ``zero_shot.avg`` (percent), ``efficiency.iter_time_ms``,
``efficiency.tflops_per_device`` (Megatron-LM model FLOPs, nominal k) and ``loss.validation``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.errors import ReproError
from repro.schema import from_json

#: ``results/published`` of this checkout.
DEFAULT_LEDGER_DIR = Path(__file__).resolve().parents[2] / "results" / "published"


@dataclass(frozen=True)
class Tolerance:
    """How far a measurement may be from a published number and still agree with it.

    Args:
        kind: ``"abs"`` (|measured - published| <= value) or ``"rel"`` (<= value * |published|).
        value: the bound, >= 0.
        rationale: why this bound (one or two sentences).
    """

    kind: str
    value: float
    rationale: str

    def __post_init__(self) -> None:
        if self.kind not in ("abs", "rel"):
            raise ValueError(f"tolerance kind must be 'abs' or 'rel', got '{self.kind}'")
        if self.value < 0:
            raise ValueError(f"tolerance value must be >= 0, got {self.value}")

    def allows(self, measured: float, reference: float) -> bool:
        bound = self.value if self.kind == "abs" else self.value * abs(reference)
        return abs(measured - reference) <= bound + 1e-12

    def describe(self) -> str:
        """Short text, e.g. ``+-1.5`` or ``+-10%``."""
        return f"+-{self.value:g}" if self.kind == "abs" else f"+-{self.value * 100:g}%"


@dataclass(frozen=True)
class Setting:
    """The experimental setting a published number was measured in (fields: results/published/README.md).

    Args:
        model_id: this suite's flavour for the architecture (``"185m"``); runs compare only when their
            ``experiment.model`` equals it.
        hardware: accelerator (None: not tied to one); efficiency entries compare only with runs on a device
            whose name contains its model (e.g. ``H100``).
    """

    model: str
    model_id: str
    num_experts: int | None
    top_k: int | None
    tokens: str
    dataset: str
    hardware: str | None
    num_devices: int | None
    note: str | None = None


@dataclass(frozen=True)
class PublishedEntry:
    """One published number as printed in ``paper``'s ``table`` (fields: results/published/README.md).

    Args:
        measured_in: the paper table that measured it (this table unless copied), e.g. ``ReMoE Table 2``: the
            provenance the tables and checks name.
        copied: a reprint of another paper's measurement (checks use originals only).
        metric: the shared metric name (module docstring).
    """

    id: str
    paper: str
    table: str
    row: str
    router: str
    setting: Setting
    measured_in: str
    copied: bool
    metric: str
    value: float
    unit: str
    tolerance: Tolerance


def load_json(path: str | Path, what: str = "results") -> Any:
    """A JSON file (``summary.json``, a benchmark JSON, a ledger file); ReproError naming ``what`` if unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReproError(f"{path}: cannot read {what}: {exc}") from None


def load_ledger_file(path: str | Path) -> list[PublishedEntry]:
    """The entries of one ledger file, ``{"description": str, "entries": [...]}``, validated.

    Raises:
        ReproError: unreadable JSON, or an entry with a missing or mistyped field (named by index and id).
    """
    data = load_json(path, "ledger file")
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ReproError(f"{path}: a ledger file must be an object with an 'entries' list")
    if not isinstance(data.get("description"), str):
        raise ReproError(f"{path}: missing field 'description' (a string)")
    entries = []
    for i, raw in enumerate(data["entries"]):
        name = raw.get("id") if isinstance(raw, dict) else None
        origin = f"{path}: entry {i}" + (f" ('{name}')" if isinstance(name, str) else "")
        entries.append(from_json(PublishedEntry, raw, origin))
    return entries


def load_ledger(ledger_dir: str | Path | None = None) -> list[PublishedEntry]:
    """The entries of every ``*.json`` in ``ledger_dir`` (default ``results/published``), files in name order.

    Raises:
        ReproError: no ledger files, an invalid entry, or a duplicated entry id.
    """
    directory = Path(ledger_dir) if ledger_dir is not None else DEFAULT_LEDGER_DIR
    files = sorted(directory.glob("*.json"))
    if not files:
        raise ReproError(f"{directory}: no published-number files (*.json) found")
    entries: list[PublishedEntry] = []
    seen: dict[str, Path] = {}
    for file in files:
        for entry in load_ledger_file(file):
            if entry.id in seen:
                raise ReproError(f"{file}: entry id '{entry.id}' is already used in {seen[entry.id]}")
            seen[entry.id] = file
            entries.append(entry)
    return entries


def select(
    entries: list[PublishedEntry], *, router: str | None = None, metric: str | None = None,
    model_id: str | None = None, originals_only: bool = False,
) -> list[PublishedEntry]:
    """Entries matching every given criterion, in ledger order; ``originals_only`` drops copies."""
    return [
        e for e in entries
        if (router is None or e.router == router) and (metric is None or e.metric == metric)
        and (model_id is None or e.setting.model_id == model_id) and not (originals_only and e.copied)
    ]
