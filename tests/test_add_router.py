"""The "Adding a router" walkthrough of docs/routers.md: one file in a package of the user's own, one entry point, and
the contract suite and the comparison come for free, without editing this repository.

The package is written to a temporary directory outside the repository and made importable the way an
installed package is: a ``*.dist-info`` directory with ``entry_points.txt`` beside it on ``sys.path`` (what
``pip install`` leaves in site-packages), so ``importlib.metadata`` finds its ``dirmoe_bench.routers``
entry point and the registry imports it; nothing in the tests imports it directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import routers
from routers import registry

REPO = Path(__file__).resolve().parents[1]
NAME = "plain_topk"

# Step 1: one file with a frozen config and the router (here: softmax top-k with no load balancing). This
# is the example of docs/routers.md ("Adding a router"), verbatim.
ROUTER_FILE = '''\
from dataclasses import dataclass

import torch

from routers import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, register_router, routing_metrics


@dataclass(frozen=True)
class PlainTopKConfig(RouterConfig):
    """Options of the example router.

    Args:
        init_std: std of the gate's normal initialisation.
    """

    init_std: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")


@register_router("plain_topk")
class PlainTopKRouter(Router):
    """Softmax over a linear gate, keep the top-k probabilities (no load balancing)."""

    Config = PlainTopKConfig

    def __init__(self, config: PlainTopKConfig) -> None:
        super().__init__(config)
        self.weight = torch.nn.Parameter(torch.randn(config.num_experts, config.hidden_size) * config.init_std)

    @property
    def constraint(self) -> RoutingConstraint:
        return RoutingConstraint(RoutingKind.EXACT_K, self.top_k, self.top_k, top_k=self.top_k)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        scores_TE = torch.softmax(hidden_TD.float() @ self.weight.float().t(), dim=-1)
        top_TK = scores_TE.topk(self.top_k, dim=-1).indices
        map_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(-1, top_TK, True)
        probs_TE = scores_TE * map_TE
        return RouterOutput(probs_TE, map_TE, {}, routing_metrics(probs_TE, map_TE))
'''

# Step 2: register it through the entry-point group in the package's metadata (the user's pyproject.toml
# says `[project.entry-points."dirmoe_bench.routers"] plain_topk = "my_moe_routers.plain_topk"`).
ENTRY_POINTS = '[dirmoe_bench.routers]\nplain_topk = my_moe_routers.plain_topk\n'


@pytest.fixture(scope="module")
def external_package(tmp_path_factory):
    """An installed-style package outside the repository, importable here and in subprocesses."""
    root = tmp_path_factory.mktemp("site")
    (root / "my_moe_routers").mkdir()
    (root / "my_moe_routers" / "__init__.py").write_text("")
    (root / "my_moe_routers" / "plain_topk.py").write_text(ROUTER_FILE)
    info = root / "my_moe_routers-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-moe-routers\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    sys.path.insert(0, str(root))
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), str(REPO), old_path) if p)
    registry._load_builtins.cache_clear()  # look for entry points again, now that the package is installed
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


def test_the_entry_point_registers_the_router(external_package):
    assert NAME in routers.available_routers()
    assert "my_moe_routers.plain_topk" in sys.modules  # imported by the registry's entry-point scan
    router = routers.build_router(NAME, hidden_size=16, num_experts=4, top_k=2, init_std=0.02)
    assert type(router).__module__ == "my_moe_routers.plain_topk" and router.config.init_std == 0.02
    with pytest.raises(ValueError, match="valid: init_std"):
        routers.build_router(NAME, hidden_size=16, num_experts=4, init_sd=0.02)
    from repro.experiments import experiment_names, get_experiment

    assert {f"{NAME}-tiny", f"{NAME}-185m"} <= set(experiment_names())
    assert get_experiment(f"{NAME}-tiny").router.name == NAME


def test_a_broken_entry_point_is_one_clear_error(tmp_path):
    info = tmp_path / "broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dirmoe_bench.routers]\nbad = no_such_module_anywhere\n")
    sys.path.insert(0, str(tmp_path))
    registry._load_builtins.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"router entry point 'bad = no_such_module_anywhere' "
                                              r"\(dirmoe_bench.routers\) failed to import"):
            routers.available_routers()
    finally:
        sys.path.remove(str(tmp_path))
        registry._load_builtins.cache_clear()
    assert "switch" in routers.available_routers()  # uninstalled: the registry loads again


# Step 3: the contract suite runs over every installed router, this one included, with no change to the suite.
@pytest.mark.slow
def test_contract_suite_covers_the_installed_router(external_package):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests" / "test_router_contract.py"),
           "-k", NAME]
    proc = subprocess.run(cmd, cwd=REPO, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    passed = int(proc.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 7, proc.stdout[-500:]  # every contract check, parametrised over the new router


# Step 4: a first comparison run on the embedded default, beside Switch, with the tables.
@pytest.mark.slow
def test_mini_comparison_with_the_installed_router(external_package, tmp_path, mini_pile, quick_mini):
    from repro.studies import mini

    argv = ["--runs", f"switch,{NAME}", "--steps", "6", "--eval-limit", "6", "--data-dir", str(mini_pile),
            "--work-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
            "--set", "validation.interval=0", "--set", "checkpoint.interval=0"]
    assert mini.main(argv) == 0
    for table in ("zero_shot", "efficiency", "routing"):
        text = (tmp_path / "out" / f"{table}.md").read_text()
        assert NAME in text and "switch" in text, table
    record = json.loads((tmp_path / "runs" / NAME / "record.json").read_text())
    assert record["experiment"]["router"] == NAME
    assert all(layer["active_experts"] == pytest.approx(1.0) for layer in record["routing"])
