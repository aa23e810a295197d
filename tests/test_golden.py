"""Golden loss curves: a fresh fixed-seed run of each router in ``repro.golden.ROUTERS`` on the embedded
default reproduces the committed curve in ``tests/assets/losses/`` step by step (within ``RTOL``/``ATOL``).

When a change is meant to alter what training computes, regenerate the curves with
``python -m repro golden --refresh``, look at the diff, and commit it with the change. Not marked slow: the quick
default of ``nox -s tests`` runs it, so a change to what training computes never passes unnoticed there.
"""

from __future__ import annotations

import pytest

from repro import golden
from repro.errors import ReproError


def test_the_golden_files_are_complete_and_well_formed():
    for router in golden.ROUTERS:
        curve = golden.read_golden(router)
        assert len(curve.losses) == golden.STEPS and len(curve.data) == 64, router
        assert curve.losses[-1] < curve.losses[0], router  # training lowered the loss


def test_the_comparison_flags_a_step_that_drifts(tmp_path):
    base = golden.GoldenCurve("switch", (7.0, 6.5, 6.0), "d", "t")
    assert golden.differences(base, base) == []
    within = golden.GoldenCurve("switch", (7.0, 6.5 * (1 + golden.RTOL / 2), 6.0), "d", "t")
    assert golden.differences(within, base) == []
    drifted = golden.GoldenCurve("switch", (7.0, 6.5, 6.0 * (1 + 10 * golden.RTOL)), "d", "t")
    assert [line.split(":")[0] for line in golden.differences(drifted, base)] == ["switch step 3"]
    assert "2 steps, the golden curve has 3" in golden.differences(golden.GoldenCurve("switch", (7.0, 6.5), "d", "t"), base)[0]
    golden.write_golden(base, tmp_path)
    assert golden.read_golden("switch", tmp_path) == base
    path = golden.golden_path("switch", tmp_path)
    path.write_text(path.read_text().replace("3 6.0", "4 6.0"))
    with pytest.raises(ReproError, match=r"switch-tiny.txt:\d+: expected 'step loss'"):
        golden.read_golden("switch", tmp_path)


def test_fresh_runs_reproduce_the_golden_curves(tmp_path, mini_pile):
    data = mini_pile
    fingerprint = golden.corpus_fingerprint(data)
    recorded = {golden.read_golden(router).data for router in golden.ROUTERS}
    if recorded != {fingerprint}:
        # The mini-pile is built from text on the machine: another machine's files give another corpus.
        pytest.skip(f"the curves were recorded on another corpus ({sorted(recorded)[0][:12]}, here {fingerprint[:12]})")
    for router in golden.ROUTERS:
        curve = golden.run_curve(router, data, tmp_path / "runs")
        assert golden.differences(curve, golden.read_golden(router)) == []
