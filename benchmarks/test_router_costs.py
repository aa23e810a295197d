"""Launch and sync targets of one router call on a step that does not log (``python -m repro study
router-costs`` counts them: :mod:`repro.studies.router_costs`), as benchmarks: T=1024, D=128, E=8, k=1, forward + backward.

- DirMoE compiled (one region) launches at most 1.5x Switch's per call, eager at most 2.5x (launches = ATen ops
  outside compiled regions + the kernels the regions run: the proxy for GPU kernel launches; a region compiled
  by inductor's C++ backend has fewer kernels than on a GPU, docs/efficiency.md);
- no router forces a host synchronisation on a non-logging step (``collect_metrics=False``).

The counts do not depend on the machine; the benchmark's time is that of the counting itself.
"""

from __future__ import annotations

import pytest

import routers
from repro.studies.router_costs import profile_router

#: DirMoE's run -> (options, most launches per call as a multiple of Switch's).
DIRMOE_TARGETS = {"compiled": ({"compile_elementwise": "always"}, 1.5), "eager": ({"compile_elementwise": "never"}, 2.5)}


def _launches(counts) -> int:
    return counts["forward"].launches + counts["backward"].launches


@pytest.mark.parametrize("name", routers.available_routers())
def test_no_host_sync_on_a_non_logging_step(benchmark, name):
    counts = benchmark.pedantic(profile_router, args=(name, {}), rounds=1, iterations=1)
    syncs = {part: dict(c.sync_ops) for part, c in counts.items() if c.syncs}
    benchmark.extra_info.update(router=name, launches=_launches(counts), syncs=syncs)
    assert not syncs, f"{name} forces host syncs on a non-logging step: {syncs}"


@pytest.mark.parametrize("label", DIRMOE_TARGETS)
def test_dirmoe_launches_against_switch(benchmark, label):
    options, most = DIRMOE_TARGETS[label]
    dirmoe = benchmark.pedantic(profile_router, args=("dirmoe", options), rounds=1, iterations=1)
    ratio = _launches(dirmoe) / _launches(profile_router("switch", {}))
    benchmark.extra_info.update(router=f"dirmoe-{label}", launches=_launches(dirmoe), x_switch=ratio)
    assert ratio <= most, f"DirMoE {label}: {ratio:.2f}x Switch's launches per call (target <= {most}x)"
