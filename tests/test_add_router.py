"""The README's "Adding a router" walkthrough, step by step, with a small router defined here."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import routers
from routers import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, register_router, routing_metrics


# Step 1: one file with a frozen config and the router (here: softmax top-k with no aux loss).
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


@register_router("example_topk")  # Step 2: register it under a name.
class PlainTopKRouter(Router):
    """Softmax over a linear gate, keep the top-k probabilities (no load balancing)."""

    Config = PlainTopKConfig

    def __init__(self, config: PlainTopKConfig) -> None:
        super().__init__(config)
        self.weight = nn.Parameter(torch.randn(config.num_experts, config.hidden_size) * config.init_std)

    @property
    def constraint(self) -> RoutingConstraint:
        return RoutingConstraint(RoutingKind.EXACT_K, self.top_k, self.top_k, top_k=self.top_k)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        scores_TE = torch.softmax(hidden_TD.float() @ self.weight.float().t(), dim=-1)
        top_TK = scores_TE.topk(self.top_k, dim=-1).indices
        routing_map_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(-1, top_TK, True)
        probs_TE = scores_TE * routing_map_TE
        return RouterOutput(probs_TE, routing_map_TE, {}, routing_metrics(probs_TE, routing_map_TE))


def test_registered_and_built_by_name():
    assert "example_topk" in routers.available_routers()
    router = routers.build_router("example_topk", hidden_size=16, num_experts=4, top_k=2, init_std=0.02)
    assert isinstance(router, PlainTopKRouter) and router.config.init_std == 0.02
    with pytest.raises(ValueError, match="valid: init_std"):
        routers.build_router("example_topk", hidden_size=16, num_experts=4, init_sd=0.02)


# Step 3: the contract suite runs over every registered router, this one included.
@pytest.mark.parametrize("check", ["shapes", "aux", "grads", "seed", "eval", "state"])
def test_contract_suite_covers_the_new_router(check):
    import test_router_contract as contract

    name = "example_topk"
    {
        "shapes": lambda: contract.test_output_shapes_dtypes_and_constraint(name, True),
        "aux": lambda: contract.test_aux_losses_and_metrics(name),
        "grads": lambda: contract.test_gradients_reach_every_trainable_parameter(name),
        "seed": lambda: contract.test_same_seed_same_output(name),
        "eval": lambda: contract.test_eval_mode_is_deterministic(name),
        "state": lambda: contract.test_state_dict_round_trip_restores_schedules(name),
    }[check]()


# Step 4: a first comparison run: train it in the tiny model beside Switch and tabulate both.
@pytest.mark.slow
def test_first_comparison_run(tmp_path):
    from repro.report.records import load_record
    from repro.report.tables import efficiency_table, render, routing_table
    from repro.training.experiments import apply_overrides, get_experiment
    from repro.training.loop import train

    common = ["data=synthetic", "steps=6", "log_interval=1", "eval_interval=0", "checkpoint_interval=0"]
    for router in ("example_topk", "switch"):
        exp = apply_overrides(get_experiment("switch-tiny"), [f"router={router}", *common])
        summary = train(exp, tmp_path / router, progress=False)
        assert summary["final_loss"] == summary["final_loss"]  # finite, not NaN
    records = [load_record(tmp_path / r / "record.json") for r in ("example_topk", "switch")]
    text = render(efficiency_table(records), "md") + render(routing_table(records), "md")
    assert "example_topk" in text and "switch" in text
    assert records[0].routing and all(layer.active_experts == pytest.approx(1.0) for layer in records[0].routing)
