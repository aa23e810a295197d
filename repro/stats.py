"""Statistics for comparing routers: intervals over seeds, paired tests over seeds and over questions.

Seeds (init, data order, router noise) are independent within a router and paired across routers by seed (same
data order): :func:`mean_ci`, :func:`prediction_interval`, :func:`paired_t_test`. Questions (the finite benchmark)
pair two models' per-question results: :func:`mcnemar_exact` (0/1), :func:`paired_permutation_test` (scores);
:func:`per_question_scores` reads lm-eval's ``log_samples`` output.

Decisions:

1. **Student t** interval of a mean over seeds: ``mean +- t_{n-1,(1+c)/2} s / sqrt(n)``, ``s`` with n - 1.
2. **The regression band is a prediction interval**, ``mean +- t_{n-1,(1+c)/2} s sqrt(1 + 1/n)``: where one more
   seed falls with probability ``c`` under the same normal model (the mean's interval shrinks with more seeds).
3. **McNemar's exact test** for 0/1 outcomes (Dietterich 1998): ``c ~ Binomial(b + c, 1/2)`` over the ``b + c``
   discordant questions under no difference, two-sided ``scipy.stats.binomtest``; exact, as the counts are small.
4. **Paired sign-flip permutation test** for non-0/1 scores (each difference as likely positive as negative):
   exact over the ``2^m`` sign patterns of the ``m`` non-zero differences when ``2^m <= n_resamples``, or at any
   ``m`` by convolution when all terms are integer multiples of the smallest (0/1: McNemar's exact test); else a
   seeded Monte Carlo ``p = (1 + #{|T*| >= |T|}) / (1 + R)`` (Phipson & Smyth 2010), named as such. Not a
   bootstrap: its small-sample p-values are only approximate.
5. **Holm's step-down adjustment** (Holm 1979) over a family fixed before the data (:mod:`repro.report.over_seeds`):
   controls the family-wise error rate under any dependence.
6. **A test with no spread is undefined, not significant**: :func:`paired_t_test` gives ``p = nan`` when all
   differences are equal; tables footnote such cells and Holm's family leaves them out.
7. **lm-eval's standard error** (``acc_stderr``, ``lm_eval/api/metrics.py:mean_stderr``) is ``s / sqrt(n)`` over
   0/1 scores, ``s`` with n - 1.
8. **Power of the regression band** (:func:`minimum_detectable_shift`): a value shifted by ``delta`` makes
   ``(x - mean) / (s sqrt(1 + 1/n))`` noncentral t (``n - 1`` df, noncentrality ``delta / (sigma sqrt(1 + 1/n))``),
   solved for the smallest ``delta / sigma`` caught with the given power.
9. **Timing ratios: paired rounds in one process, batch-means interval** (:func:`timing_ratio`): per-round
   log-ratios ``d`` are autocorrelated, so ``mean d`` gets Student's t over ~``sqrt(rounds)`` consecutive batch
   means (Law & Kelton); the ratio ``exp(mean d)`` is the geometric mean of the per-round ratios.
10. **A stepped number's band is no narrower than its steps**: an accuracy on N questions moves by 1/N, and tied
    seeds (``s = 0``) would fail an honest run one question away, so the band's ``s`` is at least
    :func:`grid_sd_floor` (see :func:`repro.report.check.simulated_false_alarm`).
11. **A null result says what it could have found**: :func:`paired_detectable_effect` (80% power at Holm's first
    step; several SDs at 3 seeds: nulls are no evidence of equality). :func:`sign_flip_p` is the exact
    distribution-free test of the same mean; where they disagree, the t-test's verdict rests on normality.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as sps
from scipy.integrate import quad
from scipy.optimize import brentq


@dataclass(frozen=True)
class Interval:
    """The mean of ``n`` values and an interval of coverage ``confidence`` (``low``/``high`` None below two values)."""

    estimate: float
    low: float | None
    high: float | None
    n: int
    confidence: float

    @property
    def half_width(self) -> float | None:
        """(high - low) / 2, None where undefined."""
        return None if self.low is None or self.high is None else (self.high - self.low) / 2

    def contains(self, value: float, atol: float = 0.0) -> bool:
        """Whether ``value`` lies in [low - atol, high + atol] (False where the interval is undefined)."""
        return self.low is not None and self.high is not None and self.low - atol <= value <= self.high + atol


@dataclass(frozen=True)
class PairedTest:
    """A paired comparison of ``other`` with ``reference`` over ``n`` pairs by ``test`` (t, McNemar, sign-flip).

    Args:
        difference: other minus reference (mean paired difference, or the weighted sum).
        statistic: t; McNemar: the smaller discordant count; permutation: the difference.
        p_value: two-sided (nan where undefined: no spread, decision 6).
    """

    test: str
    difference: float
    statistic: float
    p_value: float
    n: int

    @property
    def defined(self) -> bool:
        """Whether the test has a p-value (decision 6)."""
        return math.isfinite(self.p_value)


def _array(values: Sequence[float], name: str) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of numbers")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite numbers")
    return array


def _pair(reference: Sequence[float], other: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    ref, oth = _array(reference, "reference"), _array(other, "other")
    if ref.shape != oth.shape:
        raise ValueError(f"paired samples must have the same length, got {len(ref)} and {len(oth)}")
    return ref, oth


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


@functools.lru_cache(maxsize=1024)
def _t_quantile(confidence: float, df: int) -> float:
    return float(sps.t.ppf((1 + confidence) / 2, df))


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of ``values`` (one per seed) and its Student-t interval (decision 1).

    Returns:
        The :class:`Interval` (``low``/``high`` None for a single value).

    Raises:
        ValueError: no values, non-finite values, or a confidence outside (0, 1).
    """
    _check_confidence(confidence)
    x = _array(values, "values")
    if x.size == 0:
        raise ValueError("mean_ci needs at least one value")
    mean = float(x.mean())
    if x.size < 2:
        return Interval(mean, None, None, 1, confidence)
    half = _t_quantile(confidence, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half, int(x.size), confidence)


def prediction_interval(values: Sequence[float], confidence: float = 0.95, resolution: float = 0.0) -> Interval:
    """Where one more seed falls with probability ``confidence``: ``mean +- t_{n-1} s sqrt(1 + 1/n)`` (decision 2).

    Args:
        resolution: grid step of the values (1/N for accuracy on N questions; 0: continuous), decision 10.

    Raises:
        ValueError: fewer than two values, non-finite values, or a confidence outside (0, 1).
    """
    x = _array(values, "values")
    low, high = prediction_bounds(x[None, :], confidence, resolution)
    return Interval(float(x.mean()), float(low[0]), float(high[0]), int(x.size), confidence)


def grid_sd_floor(n: int, resolution: float) -> float:
    """Smallest non-zero sample SD of ``n`` values on a grid of step ``resolution``: ``resolution / sqrt(n)``."""
    return resolution / math.sqrt(n)


def prediction_bounds(
    values_RN: np.ndarray, confidence: float = 0.95, resolution: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`prediction_interval` of each row of ``values_RN`` (N >= 2) at once: ``(low_R, high_R)``."""
    _check_confidence(confidence)
    x = np.asarray(values_RN, dtype=float)
    if x.ndim != 2 or x.shape[1] < 2:
        raise ValueError(f"a prediction interval needs at least two values, got {x.shape[-1] if x.ndim else 0}")
    if not resolution >= 0:
        raise ValueError(f"resolution must be >= 0, got {resolution}")
    mean = x.mean(axis=1)
    sd = np.maximum(x.std(axis=1, ddof=1), grid_sd_floor(x.shape[1], resolution))
    half = _t_quantile(confidence, x.shape[1] - 1) * sd * math.sqrt(1 + 1 / x.shape[1])
    return mean - half, mean + half


def _noncentrality_for_power(df: int, q: float, power: float) -> float:
    """The smallest noncentrality ``nc`` with ``P(|T'| > q) >= power`` for ``T' = (Z + nc) / sqrt(V / df)``,
    ``V ~ chi2(df)`` (``inf`` where none reaches it below 1e6)."""

    def caught(nc: float) -> float:
        # Integrated over V: scipy's nct loses precision at the large noncentralities few seeds need.
        def given(v: float) -> float:
            cut = q * math.sqrt(v / df)
            return (sps.norm.sf(cut - nc) + sps.norm.cdf(-cut - nc)) * sps.chi2.pdf(v, df)

        return float(quad(given, 0, math.inf, limit=200)[0]) - power

    if caught(0.0) >= 0:
        return 0.0
    high = 1.0
    while caught(high) < 0:
        high *= 2
        if high > 1e6:
            return math.inf
    return float(brentq(caught, 0.0, high, xtol=1e-9))


@functools.lru_cache(maxsize=256)  # quadrature is slow; a check asks the same for each number
def minimum_detectable_shift(n: int, confidence: float, power: float = 0.8) -> float:
    """Smallest shift of one new value, in seed SDs, that leaves the prediction interval w.p. ``power`` (decision 8).

    Args:
        n, confidence: seeds in the band (at least two); its coverage.
        power: probability of catching the shift.

    Returns:
        ``delta / sigma`` (``inf`` where no shift reaches that power).
    """
    _check_confidence(confidence)
    if n < 2 or not 0 < power < 1:
        raise ValueError(f"need n >= 2 and power in (0, 1), got n={n}, power={power}")
    # noncentrality = delta / (sigma sqrt(1 + 1/n)).
    return _noncentrality_for_power(n - 1, _t_quantile(confidence, n - 1), power) * math.sqrt(1 + 1 / n)


@functools.lru_cache(maxsize=256)
def paired_detectable_effect(n: int, tests: int = 1, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest mean paired difference, in SDs of the differences, that a two-sided paired t-test over ``n``
    pairs finds with probability ``power`` at level ``alpha / tests`` (decision 11): Holm's first and most
    lenient bar, so below this effect no test of the family is likely to be significant.

    Returns:
        ``|mean difference| / sd`` (``inf`` where nothing reaches that power).
    """
    if n < 2 or tests < 1 or not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"need n >= 2, tests >= 1, alpha and power in (0, 1); got {n}, {tests}, {alpha}, {power}")
    q = float(sps.t.ppf(1 - alpha / (2 * tests), n - 1))
    return _noncentrality_for_power(n - 1, q, power) / math.sqrt(n)


def sign_flip_p(differences: Sequence[float]) -> float:
    """Exact two-sided sign-flip p-value of the mean of ``differences`` (one per seed) over all ``2^n`` sign
    patterns (decision 11); at least ``2^(1 - n)``.

    Raises:
        ValueError: no differences, or more than 20 (use :func:`paired_permutation_test`).
    """
    x = _array(differences, "differences")
    if not 0 < x.size <= 20:
        raise ValueError(f"an exact sign-flip test over seeds needs 1 to 20 differences, got {x.size}")
    signs = 1 - 2 * ((np.arange(2**x.size)[:, None] >> np.arange(x.size)) & 1)
    sums = np.abs(signs @ x)
    return float(np.mean(sums >= abs(x.sum()) - 1e-12 * max(1.0, float(np.abs(x).sum()))))


@dataclass(frozen=True)
class TimingRatio:
    """``other / reference`` of paired step times from one process (decision 9).

    Args:
        ratio, low, high: ``exp(mean d)`` (geometric mean of per-round ratios); ``exp`` of d's batch-means interval.
        rounds: paired rounds used; batches: consecutive batches of ``rounds // batches`` (oldest remainder dropped).
        lag1: lag-1 autocorrelation of the per-round log-ratios, and of the batch means (near 0 if batches suffice).
        detectable: smallest relative change (``0.01``: 1%) detected with 80% power, two-sided, at ``confidence``.
        confidence: the interval's coverage.
    """

    ratio: float
    low: float
    high: float
    rounds: int
    batches: int
    lag1: float
    lag1_batch_means: float
    detectable: float
    confidence: float

    @property
    def half_width(self) -> float:
        """Relative half-width ``(high - low) / (2 ratio)`` (``0.01``: +-1%)."""
        return (self.high - self.low) / (2 * self.ratio)


def _lag1(x: np.ndarray) -> float:
    if x.size < 3 or float(np.var(x)) == 0.0:
        return 0.0
    centred = x - x.mean()
    return float(np.dot(centred[:-1], centred[1:]) / np.dot(centred, centred))


def timing_ratio(
    reference_s: Sequence[float], other_s: Sequence[float], *, batches: int | None = None, confidence: float = 0.95
) -> TimingRatio:
    """``other / reference`` of step times measured in turn, with a batch-means interval (decision 9).

    Args:
        reference_s, other_s: each round's step time of the two runs, in round order (positive).
        batches, confidence: batches in [2, rounds // 2] (None: ``floor(sqrt(rounds))`` in [2, 30]); coverage.

    Raises:
        ValueError: fewer than four rounds, unequal lengths, non-positive or non-finite times, or bad ``batches``.
    """
    _check_confidence(confidence)
    ref, oth = _pair(reference_s, other_s)
    if ref.size < 4:
        raise ValueError(f"a timing ratio needs at least 4 paired rounds, got {ref.size}")
    if np.any(ref <= 0) or np.any(oth <= 0):
        raise ValueError("step times must be positive")
    b = max(2, min(30, math.isqrt(ref.size))) if batches is None else int(batches)
    if not 2 <= b <= ref.size // 2:
        raise ValueError(f"batches must be in [2, {ref.size // 2}] for {ref.size} rounds, got {batches}")
    d = np.log(oth) - np.log(ref)
    per = d.size // b
    means = d[d.size - per * b:].reshape(b, per).mean(axis=1)  # the oldest rounds left over: warm-up's tail
    centre = float(means.mean())
    se = float(means.std(ddof=1)) / math.sqrt(b)
    half = _t_quantile(confidence, b - 1) * se
    # 80% power, two-sided at this confidence: a shift of (t_{1-a/2} + t_{0.8}) standard errors.
    detect = (_t_quantile(confidence, b - 1) + float(sps.t.ppf(0.8, b - 1))) * se
    return TimingRatio(
        ratio=math.exp(centre), low=math.exp(centre - half), high=math.exp(centre + half), rounds=int(per * b),
        batches=b, lag1=_lag1(d), lag1_batch_means=_lag1(means), detectable=math.expm1(detect),
        confidence=confidence,
    )


def paired_t_test(reference: Sequence[float], other: Sequence[float]) -> PairedTest:
    """Student's paired t-test of ``other - reference``, one value per seed in the same seed order.

    Returns:
        The :class:`PairedTest`; ``statistic`` and ``p_value`` are nan when every difference is the same to a
        relative 1e-9 (decision 6), never t = inf and p = 0.

    Raises:
        ValueError: fewer than two pairs, or samples of different lengths.
    """
    ref, oth = _pair(reference, other)
    if ref.size < 2:
        raise ValueError(f"a paired t-test needs at least two pairs, got {ref.size}")
    diff = oth - ref
    mean = float(diff.mean())
    # Equal up to floating-point rounding counts as no spread.
    if np.ptp(diff) <= 1e-9 * float(np.max(np.abs(diff))):
        return PairedTest("paired t", mean, math.nan, math.nan, int(ref.size))
    result = sps.ttest_rel(oth, ref)
    return PairedTest("paired t", mean, float(result.statistic), float(result.pvalue), int(ref.size))


def mcnemar_exact(reference: Sequence[float], other: Sequence[float]) -> PairedTest:
    """McNemar's exact test on two models' 0/1 outcomes on the same questions in the same order (decision 3).

    Returns:
        The :class:`PairedTest`: ``difference`` = accuracy(other) - accuracy(reference), ``statistic`` =
        min(b, c), b = questions only the reference got right, c = only the other.

    Raises:
        ValueError: outcomes that are not 0/1, or samples of different lengths.
    """
    ref, oth = _pair(reference, other)
    if not np.all(np.isin(ref, (0, 1)) & np.isin(oth, (0, 1))):
        raise ValueError("McNemar's test needs 0/1 outcomes; use paired_permutation_test for scores")
    b = int(np.sum((ref == 1) & (oth == 0)))
    c = int(np.sum((ref == 0) & (oth == 1)))
    p = 1.0 if b + c == 0 else float(sps.binomtest(c, b + c, 0.5).pvalue)
    return PairedTest("McNemar exact", float((c - b) / ref.size) if ref.size else 0.0, float(min(b, c)), min(1.0, p), int(ref.size))


def paired_permutation_test(
    reference: Sequence[float], other: Sequence[float], *, weights: Sequence[float] | None = None,
    n_resamples: int = 10_000, seed: int = 0,
) -> PairedTest:
    """Paired sign-flip permutation test of ``sum_i w_i (other_i - reference_i)`` (decision 4).

    Args:
        reference, other: the two models' per-question scores, same questions, same order.
        weights: per-question weights (default ``1/n``: the mean; task-weighted: ``1 / (tasks * task's questions)``).
        n_resamples, seed: most sign patterns drawn (all ``2^m`` if no more); the Monte Carlo seed.

    Returns:
        The :class:`PairedTest` (``statistic`` = ``difference``), ``test`` naming Monte Carlo estimates.

    Raises:
        ValueError: samples or weights of different lengths, non-finite values, ``n_resamples < 1``.
    """
    ref, oth = _pair(reference, other)
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    n = ref.size
    w = np.full(n, 1 / n if n else 0.0) if weights is None else _array(weights, "weights")
    if w.shape != ref.shape:
        raise ValueError(f"weights must have one entry per pair, got {w.size} for {n}")
    terms = w * (oth - ref)
    observed = float(terms.sum())
    active = terms[terms != 0]
    m = active.size
    if m == 0:
        return PairedTest("sign-flip permutation", observed, observed, 1.0, int(n))
    # Compare with a relative tolerance: the same |T| reached by another sign pattern must count as extreme.
    threshold = abs(observed) * (1 - 1e-9) - 1e-15
    name = "sign-flip permutation"
    p = _lattice_p(active, threshold)
    if p is None and m <= 62 and 2**m <= n_resamples:
        patterns = ((np.arange(2**m)[:, None] >> np.arange(m)) & 1) * 2 - 1
        p = float(np.mean(np.abs(patterns @ active) >= threshold))
    elif p is None:
        name = f"sign-flip permutation (Monte Carlo, {n_resamples} resamples)"
        rng = np.random.default_rng(seed)
        extreme, left = 0, n_resamples
        while left:  # in chunks: a resample matrix for thousands of questions would not fit in memory
            size = min(left, max(1, 2**22 // m))
            signs = rng.integers(0, 2, size=(size, m), dtype=np.int8) * 2 - 1
            extreme += int(np.sum(np.abs(signs @ active) >= threshold))
            left -= size
        p = (1 + extreme) / (1 + n_resamples)
    return PairedTest(name, observed, observed, min(1.0, p), int(n))


#: The largest lattice (sum of the terms' multiples of the smallest) whose null distribution is convolved.
_LATTICE_LIMIT = 200_000


def _lattice_p(active: np.ndarray, threshold: float) -> float | None:
    """Exact sign-flip p-value by convolution on the lattice of the smallest term (decision 4); None where the
    terms are not integer multiples of it or the lattice is too large."""
    unit = float(np.min(np.abs(active)))
    k = np.abs(active) / unit
    steps = np.round(k)
    if not np.allclose(k, steps, rtol=0, atol=1e-9) or steps.sum() > _LATTICE_LIMIT:
        return None
    dist = np.ones(1)  # dist[j]: P(T = (j - (len - 1) / 2) * unit), grown one distinct multiple at a time
    for step, count in zip(*np.unique(steps.astype(int), return_counts=True)):
        # ``count`` terms of size ``step``: their sum is step * (2B - count) with B ~ Binomial(count, 1/2).
        kernel = np.zeros(2 * step * count + 1)
        kernel[:: 2 * step] = sps.binom.pmf(np.arange(count + 1), count, 0.5)
        dist = np.convolve(dist, kernel)
    total = (dist.size - 1) // 2
    values = np.abs(np.arange(-total, total + 1) * unit)
    return float(dist[values >= threshold].sum())


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values of one family (decision 5), in the order given."""
    p = _array(p_values, "p_values")
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(p.size)
    adjusted[order] = np.maximum.accumulate(np.minimum(1.0, (p.size - np.arange(p.size)) * p[order]))
    return adjusted.tolist()


# ------------------------------------------------------------------------------------------ per question
@dataclass(frozen=True)
class QuestionScores:
    """One model's per-question scores on one task and per-document metric, in ``doc_id`` order.

    Args:
        docs_sha256: digest of the questions' ``doc_hash`` values in order; models pair only when these agree.
    """

    task: str
    metric: str
    scores: tuple[float, ...]
    docs_sha256: str

    def paired_with(self, other: QuestionScores) -> bool:
        """Whether ``other`` scored the same questions in the same order."""
        return self.task == other.task and self.docs_sha256 == other.docs_sha256 and len(self.scores) == len(other.scores)


def per_question_scores(samples: Mapping[str, Sequence[Mapping[str, Any]]], metric: str = "acc") -> dict[str, QuestionScores]:
    """Per-question scores from lm-eval's ``simple_evaluate(..., log_samples=True)["samples"]``.

    Args:
        samples: task -> per-document records (``doc_id``, ``doc_hash``, one field per metric).
        metric: per-document metric to read (``acc``, ``acc_norm``).

    Returns:
        task -> :class:`QuestionScores`, in ``doc_id`` order, for the tasks whose records carry ``metric``.

    Raises:
        ValueError: a record without ``doc_id``, a document logged twice, or a non-numeric score.
    """
    out: dict[str, QuestionScores] = {}
    for task, rows in samples.items():
        if not rows or not all(metric in row for row in rows):
            continue
        if any("doc_id" not in row for row in rows):
            raise ValueError(f"lm-eval samples of task '{task}' lack 'doc_id'")
        ordered = sorted(rows, key=lambda row: int(row["doc_id"]))
        ids = [int(row["doc_id"]) for row in ordered]
        if len(set(ids)) != len(ids):
            raise ValueError(f"lm-eval samples of task '{task}' log a document twice")
        values = [row[metric] for row in ordered]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise ValueError(f"lm-eval samples of task '{task}': '{metric}' must be numbers")
        digest = hashlib.sha256("\n".join(str(row.get("doc_hash", row["doc_id"])) for row in ordered).encode())
        out[task] = QuestionScores(task, metric, tuple(float(v) for v in values), digest.hexdigest())
    return out


def compact_per_question(samples: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """A run's per-question results, compact, for its record's ``per_question`` field.

    Args:
        samples: lm-eval's ``samples`` (the per-document metrics ``acc`` and ``acc_norm`` kept).

    Returns:
        ``{task: {"docs_sha256": str, "acc": [0, 1, ...], ...}}``, scores in ``doc_id`` order (0/1 as integers).
    """
    out: dict[str, dict[str, Any]] = {}
    for metric in ("acc", "acc_norm"):
        for task, scores in per_question_scores(samples, metric).items():
            entry = out.setdefault(task, {"docs_sha256": scores.docs_sha256})
            entry[metric] = [int(v) if v in (0.0, 1.0) else v for v in scores.scores]
    return out


def question_scores(compact: Mapping[str, Mapping[str, Any]], task: str, metric: str) -> QuestionScores | None:
    """One task's scores from a ``per_question`` field (:func:`compact_per_question`); None if absent."""
    entry = compact.get(task)
    if not isinstance(entry, Mapping) or metric not in entry:
        return None
    return QuestionScores(task, metric, tuple(float(v) for v in entry[metric]), str(entry.get("docs_sha256", "")))
