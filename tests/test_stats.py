"""Statistics for the router comparison, against textbook values and scipy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from repro.stats import (
    compact_per_question,
    holm,
    mcnemar_exact,
    mean_ci,
    minimum_detectable_shift,
    paired_permutation_test,
    paired_t_test,
    per_question_scores,
    prediction_bounds,
    prediction_interval,
    question_scores,
    timing_ratio,
)

# Cushny & Peebles' sleep data (Student 1908): extra hours of sleep under two drugs, same ten patients.
DRUG_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
DRUG_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_mean_ci_is_the_student_t_interval():
    ci = mean_ci([1, 2, 3, 4, 5])
    assert ci.estimate == 3 and ci.n == 5
    # t_{0.975, 4} = 2.776445, s = sqrt(2.5): half-width 2.776445 * 1.581139 / sqrt(5) = 1.963243
    assert ci.half_width == pytest.approx(1.963243, abs=1e-6)
    low, high = sps.t.interval(0.95, df=4, loc=3, scale=sps.sem([1, 2, 3, 4, 5]))
    assert (ci.low, ci.high) == pytest.approx((low, high), abs=1e-12)
    assert mean_ci([1, 2, 3, 4, 5], confidence=0.99).half_width > ci.half_width
    one = mean_ci([0.42])
    assert (one.estimate, one.low, one.high, one.half_width) == (0.42, None, None, None)
    with pytest.raises(ValueError, match="at least one"):
        mean_ci([])
    with pytest.raises(ValueError, match="confidence"):
        mean_ci([1, 2], confidence=1.5)
    with pytest.raises(ValueError, match="finite"):
        mean_ci([1, float("nan")])


def test_prediction_interval_formula_and_coverage():
    values = [5.1, 5.4, 5.0, 5.3]
    pi = prediction_interval(values)
    s, n = np.std(values, ddof=1), len(values)
    assert pi.half_width == pytest.approx(sps.t.ppf(0.975, n - 1) * s * math.sqrt(1 + 1 / n), rel=1e-12)
    assert pi.half_width > mean_ci(values).half_width  # one new draw is less certain than the mean
    # Its defining property: a further draw from the same normal falls inside 95% of the time.
    rng = np.random.default_rng(0)
    draws = rng.normal(2.0, 0.3, size=(4000, 4))
    inside = 0
    for row in draws:
        band = prediction_interval(row[:3])
        inside += band.contains(row[3])
    assert inside / len(draws) == pytest.approx(0.95, abs=0.012)  # 3.5 binomial standard errors
    with pytest.raises(ValueError, match="at least two"):
        prediction_interval([1.0])


def test_paired_t_test_on_students_sleep_data():
    result = paired_t_test(DRUG_1, DRUG_2)
    # The textbook result (R: t.test(extra ~ group, paired = TRUE)): t = 4.0621 on 9 df, p = 0.002833.
    assert result.statistic == pytest.approx(4.0621, abs=1e-4)
    assert result.p_value == pytest.approx(0.002833, abs=1e-6)
    assert result.difference == pytest.approx(1.58) and result.n == 10
    scipy_result = sps.ttest_rel(DRUG_2, DRUG_1)
    assert result.p_value == pytest.approx(scipy_result.pvalue, rel=1e-12)
    # no spread in the differences: the test is undefined (never t = inf, p = 0 and a mark), zero or not
    for other in ([1.0, 2.0], [1.5, 2.5]):
        undefined = paired_t_test([1.0, 2.0], other)
        assert not undefined.defined and math.isnan(undefined.p_value) and math.isnan(undefined.statistic)
        assert undefined.difference == pytest.approx(other[0] - 1.0)
    assert paired_t_test([1.0, 2.0, 3.0], [1.5, 2.5, 3.6]).defined
    # equal up to floating-point rounding (0.45 - 0.35 != 0.40 - 0.30 in the last bit) is no spread either
    assert not paired_t_test([0.30, 0.35], [0.40, 0.45]).defined
    with pytest.raises(ValueError, match="at least two pairs"):
        paired_t_test([1.0], [2.0])
    with pytest.raises(ValueError, match="same length"):
        paired_t_test([1.0, 2.0], [2.0])


def _outcomes(b: int, c: int, both: int, neither: int) -> tuple[list[int], list[int]]:
    """Reference / other 0/1 outcomes with b questions only the reference got right, c only the other."""
    ref = [1] * b + [0] * c + [1] * both + [0] * neither
    oth = [0] * b + [1] * c + [1] * both + [0] * neither
    return ref, oth


def test_mcnemar_exact_textbook_values():
    ref, oth = _outcomes(b=1, c=9, both=30, neither=20)
    result = mcnemar_exact(ref, oth)
    # two-sided exact binomial on the 10 discordant pairs: 2 * P(X <= 1 | 10, 1/2) = 2 * 11 / 1024
    assert result.p_value == pytest.approx(22 / 1024, rel=1e-12)
    assert result.statistic == 1 and result.difference == pytest.approx(8 / 60)
    assert mcnemar_exact(oth, ref).p_value == result.p_value  # symmetric
    assert mcnemar_exact(*_outcomes(b=4, c=4, both=2, neither=2)).p_value == 1.0
    assert mcnemar_exact(*_outcomes(b=0, c=0, both=3, neither=3)).p_value == 1.0
    with pytest.raises(ValueError, match="0/1"):
        mcnemar_exact([0.5, 1.0], [1.0, 0.0])


def test_permutation_test_is_exact_mcnemar_on_binary_outcomes():
    rng = np.random.default_rng(3)
    # 12 questions (2^m <= n_resamples: enumerated) and 600 (up to ~200 discordant: far beyond 2^m resamples)
    for size in [12] * 10 + [600] * 10:
        ref = rng.integers(0, 2, size=size)
        oth = np.where(rng.random(size) < 0.3, 1 - ref, ref)  # some questions flip
        ours = paired_permutation_test(ref, oth, n_resamples=1000)
        assert ours.p_value == pytest.approx(mcnemar_exact(ref, oth).p_value, rel=1e-9, abs=1e-15)
        assert ours.test == "sign-flip permutation"  # exact, not Monte Carlo


def test_permutation_test_is_exact_on_a_lattice_and_says_when_it_is_monte_carlo():
    rng = np.random.default_rng(4)
    # correctness averaged over 3 seeds: multiples of 1/3, 40 questions (2^40 patterns): exact by convolution
    ref, oth = rng.integers(0, 4, size=40) / 3, rng.integers(0, 4, size=40) / 3
    exact = paired_permutation_test(ref, oth)
    assert exact.test == "sign-flip permutation"
    monte_carlo = paired_permutation_test(ref + rng.normal(0, 1e-3, 40), oth, n_resamples=20_000, seed=1)
    assert monte_carlo.test == "sign-flip permutation (Monte Carlo, 20000 resamples)"
    assert monte_carlo.p_value == pytest.approx(exact.p_value, abs=0.02)  # the jitter barely moves it
    # the lattice against brute-force enumeration on a small case with mixed multiples
    small_ref, small_oth = np.array([0, 0, 0, 1, 2, 0, 0]) / 3, np.array([1, 2, 3, 0, 0, 1, 2]) / 3
    brute = sps.permutation_test(
        (small_oth, small_ref), lambda x, y: np.mean(x - y), permutation_type="samples", n_resamples=np.inf,
        alternative="two-sided",
    )
    assert paired_permutation_test(small_ref, small_oth, n_resamples=1).p_value == pytest.approx(brute.pvalue, abs=1e-12)


def test_permutation_test_matches_scipy_exact_and_monte_carlo_is_seeded():
    ref = [0.2, 0.5, 0.4, 0.9, 0.3, 0.6, 0.7, 0.1]
    oth = [0.3, 0.9, 0.5, 0.8, 0.6, 0.9, 0.7, 0.5]
    ours = paired_permutation_test(ref, oth)
    reference = sps.permutation_test(
        (oth, ref), lambda x, y: np.mean(x - y), permutation_type="samples", n_resamples=np.inf,
        alternative="two-sided",
    )
    assert ours.p_value == pytest.approx(reference.pvalue, abs=1e-12)
    assert ours.difference == pytest.approx(np.mean(np.subtract(oth, ref)))
    # beyond 2^m > n_resamples: Monte Carlo, reproducible for a seed, never exactly zero
    rng = np.random.default_rng(1)
    big_ref = rng.random(400)  # scores off any lattice: 2^m > n_resamples is a Monte Carlo draw
    big_oth = np.where(rng.random(400) < 0.25, big_ref + 0.5 + rng.random(400), big_ref)
    first = paired_permutation_test(big_ref, big_oth, n_resamples=2000, seed=5)
    assert first == paired_permutation_test(big_ref, big_oth, n_resamples=2000, seed=5)
    assert first.p_value == pytest.approx(1 / 2001) and "Monte Carlo" in first.test
    same = paired_permutation_test(big_ref, rng.permutation(big_ref), n_resamples=2000, seed=5)
    assert same.p_value > 0.01
    # weights: the statistic is the weighted sum of the differences
    weighted = paired_permutation_test([0, 0, 1], [1, 0, 1], weights=[0.5, 0.25, 0.25])
    assert weighted.difference == 0.5


def test_holm_step_down():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 -> kept monotone at 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([]) == []


def _samples():
    """lm-eval's per-document records (``simple_evaluate(log_samples=True)['samples']``), out of order."""
    return {
        "arc_easy": [
            {"doc_id": 1, "doc_hash": "h1", "acc": 0.0, "acc_norm": 1.0},
            {"doc_id": 0, "doc_hash": "h0", "acc": 1.0, "acc_norm": 1.0},
            {"doc_id": 2, "doc_hash": "h2", "acc": 1.0, "acc_norm": 0.0},
        ],
        "boolq": [{"doc_id": 0, "doc_hash": "b0", "acc": 1.0}, {"doc_id": 1, "doc_hash": "b1", "acc": 0.0}],
    }


def test_per_question_scores_from_lm_eval_samples():
    acc = per_question_scores(_samples(), "acc")
    assert acc["arc_easy"].scores == (1.0, 0.0, 1.0) and acc["boolq"].scores == (1.0, 0.0)
    norm = per_question_scores(_samples(), "acc_norm")
    assert set(norm) == {"arc_easy"}  # boolq has no acc_norm
    assert acc["arc_easy"].paired_with(norm["arc_easy"])
    other = _samples()
    other["arc_easy"][0]["doc_hash"] = "changed"
    assert not acc["arc_easy"].paired_with(per_question_scores(other, "acc")["arc_easy"])
    compact = compact_per_question(_samples())
    assert compact["arc_easy"]["acc"] == [1, 0, 1] and compact["arc_easy"]["acc_norm"] == [1, 1, 0]
    assert "acc_norm" not in compact["boolq"]
    assert question_scores(compact, "arc_easy", "acc") == acc["arc_easy"]
    assert question_scores(compact, "boolq", "acc_norm") is None
    twice = _samples()
    twice["boolq"][1]["doc_id"] = 0
    with pytest.raises(ValueError, match="twice"):
        per_question_scores(twice)


# ------------------------------------------------------------------------------------------ the seed check
RESULTS = Path(__file__).resolve().parents[1] / "results"


def _seed_spread() -> tuple[np.ndarray, np.ndarray]:
    """Means and standard deviations of the suite's own per-seed numbers: the ablation's reference cell over
    six seeds (10 routing and loss numbers) and the mini's Switch over three (final, validation, held-out loss)."""
    paper = json.loads((RESULTS / "dirmoe-ablation-6seeds" / "summary.json").read_text())["results"]["paper"]
    series = [list(item["values"].values()) for key, item in paper.items() if key != "seeds"]
    switch = json.loads((RESULTS / "mini-seeds" / "summary.json").read_text())["per_seed"]["switch"]
    series += [switch[k] for k in ("final_train_lm_loss_last10", "validation_loss", "heldout_loss")]
    return np.array([np.mean(s) for s in series]), np.array([np.std(s, ddof=1) for s in series])


def _false_alarms(mean_K, sd_K, seeds, confidence, reps, rng, shift_K=None):
    """Share of simulated new runs that fail: ``seeds`` earlier runs and one new run, each number an
    independent normal with the given mean and SD (the new run's shifted by ``shift_K``)."""
    K = mean_K.size
    earlier = mean_K + sd_K * rng.standard_normal((reps, seeds, K))
    new = mean_K + sd_K * rng.standard_normal((reps, K)) + (0 if shift_K is None else shift_K)
    low, high = prediction_bounds(earlier.transpose(0, 2, 1).reshape(reps * K, seeds), confidence)
    outside = (new.reshape(-1) < low) | (new.reshape(-1) > high)
    return float(outside.reshape(reps, K).any(axis=1).mean())


def test_seed_check_false_alarm_rate_is_at_most_its_stated_level():
    from repro.report.check import family_confidence

    mean_K, sd_K = _seed_spread()
    K, reps, alpha = mean_K.size, 200_000, 0.05
    se = math.sqrt(alpha * (1 - alpha) / reps)  # the Monte Carlo estimate's own error: 0.0005
    rng = np.random.default_rng(20261125)
    assert K == 13
    for seeds in (3, 6):  # the mini's seed count and the ablation's
        rate = _false_alarms(mean_K, sd_K, seeds, family_confidence(alpha, K), reps, rng)
        # independent numbers are Bonferroni's worst case: 1 - (1 - alpha/K)^K = 0.0488 at K = 13
        assert rate <= alpha + 3 * se and rate == pytest.approx(1 - (1 - alpha / K) ** K, abs=4 * se)
    # the old per-number 95% bands: an honest run failed about half the time
    old = _false_alarms(mean_K, sd_K, 3, 0.95, 20_000, rng)
    assert old == pytest.approx(1 - 0.95**K, abs=0.015) and old > 0.45


def test_seed_check_states_what_it_cannot_detect_at_three_seeds():
    from test_report import _seed_record

    from repro.report.check import DETECTION_POWER, check_against_seeds, family_confidence, final_loss, render_report

    switch = json.loads((RESULTS / "mini-seeds" / "summary.json").read_text())["per_seed"]["switch"]
    losses = switch["final_train_lm_loss_last10"]
    mean, sd, K, reps = float(np.mean(losses)), float(np.std(losses, ddof=1)), 6, 100_000
    confidence = family_confidence(0.05, K)  # the mini compares about 6 numbers
    detectable = minimum_detectable_shift(3, confidence, DETECTION_POWER) * sd
    rng = np.random.default_rng(7)
    # the power calculation against simulation: at the detectable shift, caught 80% of the time
    caught = _false_alarms(np.array([mean]), np.array([sd]), 3, confidence, reps, rng, np.array([detectable]))
    assert caught == pytest.approx(DETECTION_POWER, abs=4 * math.sqrt(0.16 / reps))
    # a real 1% shift of Switch's final loss (0.055 nats, 4.8 seed SDs): caught far less often than 80% at 3 seeds
    one_percent = _false_alarms(np.array([mean]), np.array([sd]), 3, confidence, reps, rng, np.array([0.01 * mean]))
    assert detectable > 0.01 * mean and one_percent < DETECTION_POWER
    # ... and the check says so: its row states the detectable shift, over 1% of the loss
    seeds = [_seed_record(f"s{k}", k, v - 5.0) for k, v in enumerate(losses, 1)]
    shifted = _seed_record("new", 9, 1.01 * mean - 5.0)
    assert [final_loss(s) for s in seeds] == pytest.approx(losses)
    report = check_against_seeds(shifted, seeds)
    row = next(r for r in report.rows if r.metric.startswith("loss.final"))
    assert row.detectable == pytest.approx(
        minimum_detectable_shift(3, family_confidence(0.05, report.compared), DETECTION_POWER) * sd, rel=1e-9
    )
    assert row.status == "ok" and row.detectable / mean > 0.01  # passes: below what 3 seeds can see
    text = render_report(report)
    assert f"±{row.detectable:.3g} ({100 * row.detectable / row.reference:.2g}%)" in text


# ------------------------------------------------------------------------------------------ timing ratios
def _ar1(rng: np.random.Generator, n: int, phi: float, sd: float) -> np.ndarray:
    """A stationary AR(1) series of ``n`` values, lag-1 correlation ``phi``, marginal sd ``sd``."""
    x = np.empty(n)
    x[0] = rng.normal(0.0, sd)
    innovation = sd * math.sqrt(1 - phi**2)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + rng.normal(0.0, innovation)
    return x


def _interleaved_times(rng, n, ratio, phi=0.6, drift=0.05, noise=0.05):
    """Two routers' step times stepped in turn: a drift both share (the machine's state: AR(1)), and each
    step's own autocorrelated noise, with a known ratio of their geometric means."""
    shared = _ar1(rng, n, 0.9, drift)
    ref = 0.45 * np.exp(shared + _ar1(rng, n, phi, noise))
    other = 0.45 * ratio * np.exp(shared + _ar1(rng, n, phi, noise))
    return ref, other


def test_timing_ratio_is_the_geometric_mean_ratio_with_a_batch_means_interval():
    ref = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
    r = timing_ratio(ref, [1.1 * t for t in ref])
    assert r.ratio == pytest.approx(1.1) and r.low == pytest.approx(1.1) and r.high == pytest.approx(1.1)
    d = np.log([1.2, 1.0, 1.1, 1.3, 0.9, 1.1, 1.0, 1.2, 1.05])  # 9 rounds, 3 batches of 3
    r = timing_ratio(np.ones(9), np.exp(d), batches=3)
    means = d.reshape(3, 3).mean(axis=1)
    low, high = sps.t.interval(0.95, df=2, loc=means.mean(), scale=sps.sem(means))
    assert (r.ratio, r.low, r.high) == pytest.approx((math.exp(d.mean()), math.exp(low), math.exp(high)))
    assert (r.rounds, r.batches) == (9, 3)
    with pytest.raises(ValueError, match="at least 4"):
        timing_ratio([1, 1, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="positive"):
        timing_ratio([1, 1, 0, 1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="batches"):
        timing_ratio(np.ones(8), np.ones(8), batches=5)


def test_timing_ratio_covers_a_known_ratio_under_autocorrelation_where_the_iid_interval_does_not():
    # 150 rounds of two routers whose per-step noise has lag-1 correlation 0.6 (worse than the 0.26-0.40 of the
    # H100's logs) over a shared drift: the batch-means interval holds its 95%; the naive t interval on the 150
    # per-round ratios, which assumes them independent, covers far less often.
    rng = np.random.default_rng(7)
    true, trials = 1.03, 400
    batch_hits = naive_hits = 0
    widths = []
    for _ in range(trials):
        ref, other = _interleaved_times(rng, 150, true)
        r = timing_ratio(ref, other)
        batch_hits += r.low <= true <= r.high
        widths.append(r.half_width)
        ci = mean_ci(np.log(other / ref))
        naive_hits += math.exp(ci.low) <= true <= math.exp(ci.high)
    # binomial sd at 95% over 400 trials: 1.1 points; the bounds allow ~3 sd
    assert 0.915 <= batch_hits / trials <= 0.985, batch_hits / trials
    assert naive_hits / trials < 0.85, naive_hits / trials
    # the shared drift cancels in the pairing: the width follows the steps' own noise (sd 5% each, so ~7% for
    # a round's ratio, ~37 effective rounds at this correlation: a half-width near 2 x 7% / sqrt(37) = 2.3%)
    assert 0.015 < float(np.median(widths)) < 0.035


def test_timing_ratio_power_statement_matches_simulation():
    # ``detectable`` is the shift caught with 80% power: simulate that shift and count how often the interval
    # excludes the null (1.0).
    rng = np.random.default_rng(11)
    ref, other = _interleaved_times(rng, 150, 1.0)
    shift = 1 + timing_ratio(ref, other).detectable
    caught = sum(timing_ratio(*_interleaved_times(rng, 150, shift)).low > 1.0 for _ in range(300))
    assert 0.65 <= caught / 300 <= 0.95, caught / 300
