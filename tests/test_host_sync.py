"""Nothing but training on a step that does not log: with ``collect_metrics`` off, every router computes no
diagnostic metrics and forces no host synchronisation in its forward and backward (counted with
:class:`repro.records.op_counts.OpCounter`), the step schedules read no device value, and what the
router trains with (probs, map, aux losses, gradients, random draws) is identical to a step that logs."""

from __future__ import annotations

import pytest
import torch
from test_router_contract import ALL, build, make_inputs

import routers
from repro.records.op_counts import OpCounter
from routers.megatron_adapter import RoutingStats


def _step(router: routers.Router, collect: bool, counter: OpCounter | None = None):
    """One training forward + backward of ``router`` with ``collect_metrics`` = ``collect``; returns the output,
    the input's gradient and the parameters' gradients."""
    router.train()
    routers.begin_step(router, 3, collect_metrics=collect)
    hidden_TD, token_ids_T, seq_shape = make_inputs(0)
    hidden_TD.requires_grad_(True)
    torch.manual_seed(7)
    with counter if counter is not None else torch.enable_grad():
        out = router(hidden_TD, token_ids_T, seq_shape)
        loss = (out.probs * torch.linspace(0.5, 1.5, out.probs.shape[1])).sum() + out.total_aux_loss()
        if loss.requires_grad:
            loss.backward()
    grads = {n: p.grad for n, p in router.named_parameters()}
    return out, hidden_TD.grad, grads


@pytest.mark.parametrize("name", ALL)
def test_a_step_that_does_not_log_forces_no_host_sync_and_computes_no_metrics(name):
    counter = OpCounter()
    out, _, _ = _step(build(name), collect=False, counter=counter)
    assert counter.counts.dispatched > 0  # the counter saw the router's work
    assert dict(counter.counts.sync_ops) == {}, f"{name}: host synchronisations {dict(counter.counts.sync_ops)}"
    assert out.metrics == {}


@pytest.mark.parametrize("name", ALL)
def test_collecting_metrics_changes_nothing_the_router_trains_with(name):
    on, grad_in_on, grads_on = _step(build(name), collect=True)
    off, grad_in_off, grads_off = _step(build(name), collect=False)
    assert on.metrics  # a logging step reports its routing
    assert torch.equal(on.probs, off.probs) and torch.equal(on.routing_map, off.routing_map)
    assert on.aux_losses.keys() == off.aux_losses.keys()
    for key in on.aux_losses:
        assert torch.equal(on.aux_losses[key], off.aux_losses[key]), key
    assert (grad_in_on is None) == (grad_in_off is None)
    if grad_in_on is not None:
        assert torch.equal(grad_in_on, grad_in_off)
    for key, grad in grads_on.items():
        assert (grad is None and grads_off[key] is None) or torch.equal(grad, grads_off[key]), key


def test_remoe_schedule_updates_on_the_device_without_host_sync():
    lam0 = build("remoe").l1_coeff.clone()
    coefficients = []
    for collect in (True, False):
        model = torch.nn.ModuleList([build("remoe"), build("remoe", seed=1)]).train()
        routers.begin_step(model, 0, collect_metrics=collect)
        forward = OpCounter()
        with forward:
            for layer in model:
                layer(make_inputs(0)[0])
        schedule = OpCounter()
        with schedule:
            averaged = routers.end_step(model)
        assert dict(schedule.counts.sync_ops) == {}  # the schedule never reads a device value
        assert collect or dict(forward.counts.sync_ops) == {}
        assert torch.is_tensor(averaged["remoe"])
        coefficients.append([layer.l1_coeff.clone() for layer in model])
        assert all(layer.step_statistic() is None for layer in model)  # accumulators reset
    # Nearly dense at initialisation (S ~ 1/2 < 7/8): lambda rose by exactly 1.2 either way.
    assert all(torch.equal(a, b) for a, b in zip(*coefficients))
    assert torch.equal(coefficients[0][0], lam0 * 1.2)


def test_routing_stats_average_metrics_over_the_forwards_that_returned_them():
    stats = RoutingStats()
    stats.add({"active_experts": torch.tensor(2.0)}, {"loss": torch.tensor(1.0)})
    stats.add({}, {"loss": torch.tensor(3.0)})  # a forward that collected no metrics
    metrics, aux = stats.means()
    assert metrics == {"active_experts": torch.tensor(2.0)} and aux == {"loss": torch.tensor(2.0)}
    stats.reset()
    stats.add({}, {"loss": torch.tensor(3.0)})
    assert stats.means() == ({}, {"loss": torch.tensor(3.0)})


def test_the_counter_recognises_host_syncs_and_lets_the_rest_pass():
    x = torch.tensor([3.0, -1.0, 2.0])
    with OpCounter() as counter:
        x.topk(2)
        torch.where(x > 0, x, 0.0)
        x.masked_fill(x < 0, 0.0)
        torch._assert_async((x < 5).all())
    assert counter.counts.dispatched >= 6 and dict(counter.counts.sync_ops) == {}
    with OpCounter() as counter:
        float(x.sum())
        bool((x > 0).any())
        x[x > 0]
        torch.nonzero(x)
        torch.unique(x)
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.equal(x, x)
    syncs = counter.counts.sync_ops
    assert syncs["_local_scalar_dense"] >= 2 and syncs["index(bool mask)"] == 1
    assert syncs["nonzero"] >= 1 and syncs["equal"] == 1
    assert syncs["repeat_interleave(no output_size)"] == 1
    assert any(k.startswith("_unique") or k.startswith("unique") for k in syncs)
