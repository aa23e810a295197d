"""One over-seeds comparison for every seeded table (:mod:`repro.report.seed_tables`,
:mod:`repro.report.ablation_tables`): row ``a`` against row ``b`` in a column is a paired t-test over the seeds
both ran (same seed: same data order and initial backbone) with the Student-t interval of the differences, or a
test the caller supplies; the p-values of one *family* are Holm-adjusted together. Families are fixed by the
table's definition, before the data: ``table`` (default: a reader scans the whole table for marks) or ``column``
(each column alone). A test with no spread is undefined: no mark, left out of its family, named in a footnote.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from repro.report.table_core import SIGNIFICANT
from repro.stats import Interval, PairedTest, holm, mean_ci, paired_t_test

#: The families a table's tests can be adjusted in (module docstring).
FAMILIES = ("table", "column")
#: Values per seed: row -> column -> seed -> value (a seed without the value is absent).
Values = Mapping[str, Mapping[str, Mapping[int, float]]]


@dataclass(frozen=True)
class SeedStat:
    """One row's value in one column over its seeds, and its comparison with another row.

    Args:
        interval: mean and Student-t interval over the row's seeds (None: no value).
        test: the paired test (None: not compared, or fewer than two shared seeds).
        adjusted_p: Holm-adjusted p-value over its family (None: no test, or undefined).
        difference: mean and Student-t interval of row minus the other (None: test not over seeds).
        family_size: the defined tests of its Holm family (0: not in one).
    """

    interval: Interval | None
    test: PairedTest | None = None
    adjusted_p: float | None = None
    difference: Interval | None = None
    family_size: int = 0

    @property
    def defined(self) -> bool:
        return self.test is not None and self.test.defined

    @property
    def undefined(self) -> bool:
        """Whether the test could not be run (paired differences with no spread)."""
        return self.test is not None and not self.test.defined

    def significant(self, alpha: float) -> bool:
        return self.adjusted_p is not None and self.adjusted_p < alpha


def check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown family '{family}'; valid: {', '.join(FAMILIES)}")
    return family


Key = tuple[str, str, str]


def compare(
    values: Values, tests: Sequence[Key], *, family: str = "table", confidence: float = 0.95,
    test: Callable[[str, str, str], PairedTest | None] | None = None,
) -> dict[Key, SeedStat]:
    """Every comparison ``(a, b, column)`` (``a`` against ``b``), Holm-adjusted over its family.

    Args:
        values: row -> column -> seed -> value.
        tests: the comparisons, ``(a, b, column)``.
        family: ``table`` (all comparisons one family) or ``column`` (one per column).
        confidence: interval coverage.
        test: ``(a, b, column) -> PairedTest`` replacing the paired t (no difference interval then).

    Returns:
        ``(a, b, column)`` -> :class:`SeedStat` (``interval`` is ``a``'s over its seeds).
    """
    check_family(family)

    def paired(a: str, b: str, column: str) -> tuple[PairedTest, Interval | None] | None:
        """``test``'s result, or the paired t-test of ``a - b`` over shared seeds and the differences' interval
        (None below two shared seeds)."""
        if test is not None:
            return None if (result := test(a, b, column)) is None else (result, None)
        mine, theirs = values.get(a, {}).get(column, {}), values.get(b, {}).get(column, {})
        shared = sorted(set(mine) & set(theirs))
        if len(shared) < 2:
            return None
        first, second = [mine[s] for s in shared], [theirs[s] for s in shared]
        return paired_t_test(second, first), mean_ci([x - y for x, y in zip(first, second)], confidence)

    found = {key: p for key in tests if (p := paired(*key)) is not None}
    # Holm per family over defined tests (an undefined one cannot raise a false alarm).
    families: dict[str, list[Key]] = {}
    for key, (result, _) in found.items():
        if result.defined:
            families.setdefault(key[2] if family == "column" else "", []).append(key)
    adjusted: dict[Key, float] = {}
    size: dict[Key, int] = {}
    for keys in families.values():
        adjusted.update(zip(keys, holm([found[k][0].p_value for k in keys])))
        size.update(dict.fromkeys(keys, len(keys)))
    out = {}
    for key in tests:
        a, _, column = key
        result, diff = found.get(key, (None, None))
        out[key] = SeedStat(_interval(values, a, column, confidence), result, adjusted.get(key), diff, size.get(key, 0))
    return out


def _interval(values: Values, row: str, column: str, confidence: float) -> Interval | None:
    """The mean and Student-t interval of ``row``'s values in ``column`` over its seeds (None: no value)."""
    own = list(values.get(row, {}).get(column, {}).values())
    return mean_ci(own, confidence) if own else None


def against_reference(
    values: Values, columns: Sequence[str], reference: str | None, *, family: str = "table", confidence: float = 0.95,
    tested: bool = True, test: Callable[[str, str, str], PairedTest | None] | None = None,
) -> dict[str, dict[str, SeedStat]]:
    """row -> column -> :class:`SeedStat` for every row and column: the interval and, where ``tested`` and a
    ``reference`` row exists, the comparison with it (other arguments: :func:`compare`)."""
    others = [r for r in values if r != reference] if tested and reference is not None else []
    stats = compare(values, [(r, reference, c) for c in columns for r in others], family=family,
                    confidence=confidence, test=test)
    return {row: {column: stats.get((row, reference, column)) or SeedStat(_interval(values, row, column, confidence))
                  for column in columns} for row in values}


def family_sentence(family: str, count: int, rows: str = "rows") -> str:
    """The caption's family words (``Holm-adjusted over ...``) for ``count`` defined tests over ``rows``."""
    if check_family(family) == "table":
        return (f"Holm-adjusted over all {count} tests of this table (family: the table, every test its {rows} and "
                "columns define, whatever the results)")
    return f"Holm-adjusted over the {rows} of each column (family: a column, whatever the results)"


def undefined_note(undefined: Sequence[tuple[str, str]]) -> str:
    """The caption's footnote (leading space; '' when none) naming ``(row, column label)`` with undefined tests."""
    if not undefined:
        return ""
    listed = "; ".join(f"{row} in {column}" for row, column in undefined)
    return (
        " Test undefined, so not marked (every paired difference over the shared seeds the same: no spread to "
        f"test it against, t would divide by zero): {listed}."
    )


def marks_sentence(
    reference: str, alpha: float, test: str, family: str, stats: Mapping[str, Mapping[str, SeedStat]], rows: str,
    labels: Mapping[str, str],
) -> str:
    """The caption's sentence on the marks of ``stats`` (row -> column -> stat) against ``reference`` by ``test``
    (words), with the footnote on undefined tests (``rows``, ``labels``: :func:`family_sentence`, column labels)."""
    return (
        f"{SIGNIFICANT}: differs from '{reference}' at alpha = {alpha:g} by {test}, "
        f"{family_sentence(family, count_defined(stats), rows)}." + undefined_note(undefined_cells(stats, labels))
    )


def undefined_cells(stats: Mapping[str, Mapping[str, SeedStat]], labels: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(row, column label)`` of the undefined tests among ``stats`` (row -> column -> stat), in table order."""
    return [(row, labels.get(column, column)) for row, cells in stats.items()
            for column, s in cells.items() if s.undefined]


def count_defined(stats: Mapping[str, Mapping[str, SeedStat]]) -> int:
    return sum(s.defined for cells in stats.values() for s in cells.values())
