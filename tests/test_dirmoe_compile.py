"""DirMoE's cost on a step that does not log, and its compiled region against the eager reference: metrics gated
by ``collect_metrics`` (bit-identical training, no host sync), the region traced as one graph, the compile modes'
checks and fallback, compiled == eager at fixed noise and in distribution with inductor's RNG; and the op
counter of the cost report (repro/records/op_counts.py) on cases whose counts are known."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import routers
import routers.dirmoe_blocks as blocks
from repro.records.op_counts import OpCounter, generated_kernels
from routers import dirmoe

E = 8
VARIANTS = {
    "default": {},
    "data-mean-balance": {"recon_target": "data_mean", "balance_loss_coeff": 0.01, "decoder_hidden_size": 16},
    "normalized-topk": {"posterior_scale": "normalized", "dispatch": "topk", "recon_target": "centered",
                        "dense_steps": 3},
}


def _dirmoe(mode: str = "never", seed: int = 0, hidden: int = 32, **options) -> routers.Router:
    torch.manual_seed(seed)
    return routers.build_router("dirmoe", hidden_size=hidden, num_experts=E, top_k=1, compile_elementwise=mode,
                                **options)


def _step(router, x, signal, u_TE=None, seed=5):
    """One training forward + backward at a fixed seed; returns what the training sees."""
    torch.manual_seed(seed)
    router.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = router._route_fp32(x, u_TE) if u_TE is not None else router(x)
    ((out.probs * signal).sum() + out.total_aux_loss()).backward()
    grads = {name: p.grad for name, p in router.named_parameters()}
    return out, grads, x.grad, {name: b.clone() for name, b in router.named_buffers()}, torch.rand(3)


# ------------------------------------------------------------------------------ metrics gating
@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_metrics_off_changes_nothing_the_training_computes(options):
    """collect_metrics False: no metrics, and probs, map, aux losses, gradients, buffers and the RNG stream after
    the step are bit-identical to the step with metrics."""
    x, signal = torch.randn(64, 32), torch.randn(64, E)
    results = {}
    for collect in (True, False):
        router = _dirmoe(**options).train()
        router.collect_metrics = collect
        results[collect] = _step(router, x, signal)
    (on, grads_on, xg_on, bufs_on, rng_on), (off, grads_off, xg_off, bufs_off, rng_off) = results[True], results[False]
    assert off.metrics == {} and {"kl", "simpson_theta", "load_imbalance"} <= on.metrics.keys()
    assert torch.equal(on.probs, off.probs) and torch.equal(on.routing_map, off.routing_map)
    assert on.aux_losses.keys() == off.aux_losses.keys()
    assert all(torch.equal(on.aux_losses[n], off.aux_losses[n]) for n in on.aux_losses)
    assert grads_on.keys() == grads_off.keys() and all(torch.equal(grads_on[n], grads_off[n]) for n in grads_on)
    assert torch.equal(xg_on, xg_off) and torch.equal(rng_on, rng_off)
    assert all(torch.equal(bufs_on[n], bufs_off[n]) for n in bufs_on)


def test_no_host_sync_without_metrics():
    """The counter sees the metrics' syncs (simpson_index's bool) and none once they are off, forward + backward."""
    x = torch.randn(64, 32, requires_grad=True)
    syncs = {}
    for collect in (True, False):
        router = _dirmoe(**VARIANTS["data-mean-balance"]).train()
        router.collect_metrics = collect
        with OpCounter() as counter:
            router(x).total_aux_loss().backward()
        syncs[collect] = counter.counts.syncs
    assert syncs[True] > 0 and syncs[False] == 0


def test_schedule_is_computed_once_per_step_state():
    """The eager path reuses the schedule's tensors within a step and recomputes them whenever the step buffer
    is written (set_step, load_state_dict) or inference mode changes; the values are schedule_values()'s."""
    router = _dirmoe(schedule_steps=100)
    first = router._step_schedule()
    assert router._step_schedule() is first
    router.set_step(40)
    moved = router._step_schedule()
    assert moved is not first and float(moved["tau"]) < float(first["tau"])
    state = router.state_dict()
    state["step"] = torch.tensor(7)
    router.load_state_dict(state)
    restored = router._step_schedule()
    assert restored is not moved and all(torch.equal(restored[k], v) for k, v in router.schedule_values().items())
    with torch.inference_mode():
        assert router._step_schedule() is not restored
    router.step = torch.tensor(7)  # a new buffer with the same value and a fresh version counter
    assert router._step_schedule() is not restored
    with OpCounter() as counter:
        router._step_schedule()
    assert counter.counts.dispatched == 0  # a hit reads no tensor


# ------------------------------------------------------------------------------ the op counter
def test_op_counter_counts_ops_views_syncs_and_bytes():
    x = torch.arange(6.0)
    with OpCounter() as counter:
        y = x * 2  # one op: 24 bytes in, 24 out
        y.view(2, 3)  # a view: no bytes
        float(y.sum())  # sum, then a sync (_local_scalar_dense)
        y[y > 4]  # gt, then boolean-mask indexing (a sync)
        y.nonzero()  # a sync
        y.tolist()  # a host read without an op on the CPU
    c = counter.counts
    assert c.views == 1 and c.regions == 0 and c.outside == c.dispatched
    assert c.syncs == 4 and c.sync_ops["tolist"] == 1 and c.sync_ops["nonzero"] == 1
    assert c.bytes_moved >= 48 + 24 + 4
    assert torch.Tensor.tolist.__name__ == "tolist"  # restored on exit


def test_generated_kernels_are_the_kernel_calls_in_a_graphs_call_function():
    cpu = ("cpp_fused_sin_0 = async_compile.cpp_pybinding(...)\n\ndef call(args):\n    buf0 = empty_strided_cpu((4,), (1,))\n"
           "    cpp_fused_sin_0(arg0_1, buf0)\n    extern_kernels.mm(buf0, arg1_1, out=buf1)\n"
           "    cpp_fused_relu_sum_1(buf1, buf2)\n    return (buf2, )\n")
    triton = ("def call(args):\n    triton_poi_fused_sin_0.run(arg0_1, buf0, 4, stream=stream0)\n"
              "    triton_per_fused_relu_sum_1.run(buf1, buf2, 4, 8, stream=stream0)\n")
    assert generated_kernels(cpu) == 2 and generated_kernels(triton) == 2 and generated_kernels("x = 1\n") == 0


def test_op_counter_counts_the_kernels_a_compiled_region_runs():
    """A region launches inductor's generated kernels and the extern ops it calls, not one launch in all."""
    if not blocks.inductor_available(torch.device("cpu"))[0]:
        pytest.skip("no C++ compiler for inductor on this machine")
    f = torch.compile(lambda x, w: (x.sin() @ w).relu().sum(0))
    x, w = torch.randn(16, 8), torch.randn(8, 4)
    f(x, w)  # compiles
    with OpCounter() as counter:
        f(x, w)
    c = counter.counts
    assert c.regions == 1 and c.outside == 0 and c.ops["mm"] == 1  # the matmul is an extern kernel
    assert c.region_kernels >= 3 and c.launches == c.region_kernels  # sin, mm, then relu and sum (one or two)


# ------------------------------------------------------------------------------ compile modes
def _probes(monkeypatch, triton=True, cc=True, cxx=True):
    monkeypatch.setattr(blocks, "_has_triton", lambda: triton)
    monkeypatch.setattr(blocks, "_c_compiler", lambda: "/usr/bin/gcc" if cc else None)
    monkeypatch.setattr(blocks, "_cxx_compiler", lambda: "/usr/bin/g++" if cxx else None)
    blocks.warn_eager_fallback.cache_clear()


def test_compile_modes_choose_by_device(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    _probes(monkeypatch)
    assert not _dirmoe("auto").compiles_elementwise(cpu)  # the default: eager on the CPU
    assert _dirmoe("auto").compiles_elementwise(cuda)
    assert _dirmoe("always").compiles_elementwise(cpu)
    assert not _dirmoe("never").compiles_elementwise(cuda)
    assert routers.router_class("dirmoe").Config(hidden_size=8, num_experts=4).compile_elementwise == "auto"


@pytest.mark.parametrize(
    "missing, device, named",
    [({"triton": False}, "cuda", "Triton"), ({"cc": False}, "cuda", "a C compiler"),
     ({"triton": False, "cc": False}, "cuda", "Triton and a C compiler"), ({"cxx": False}, "cpu", "a C++ compiler")],
    ids=["no-triton", "no-c-compiler", "neither", "cpu-no-cxx"],
)
def test_auto_falls_back_with_one_warning_and_always_names_what_is_missing(monkeypatch, missing, device, named):
    _probes(monkeypatch, **missing)
    dev = torch.device(device)
    if device == "cuda":
        with pytest.warns(UserWarning, match=f"needs {re.escape(named)}") as caught:
            assert not _dirmoe("auto").compiles_elementwise(dev)
            assert not _dirmoe("auto", seed=1).compiles_elementwise(dev)  # a second router: no second warning
        assert len([w for w in caught if "DirMoE runs eager" in str(w.message)]) == 1
    with pytest.raises(ValueError, match=f"cannot compile on {device}: {re.escape(named)}.* is missing") as err:
        _dirmoe("always").compiles_elementwise(dev)
    assert "\n" not in str(err.value)


def test_available_compilers_are_what_the_probes_find(monkeypatch):
    """On this machine: the CPU check is what inductor's own search finds; CC overrides the C compiler's search."""
    assert blocks.inductor_available(torch.device("cpu"))[0] == (blocks._cxx_compiler() is not None)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert blocks._c_compiler() is None
    assert not blocks.inductor_available(torch.device("meta"))[0]


# ------------------------------------------------------------------------------ one compiled region
@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_route_core_traces_as_one_graph(options):
    """The whole of the training's maths, random draws included, is one graph for dynamo (a break would split
    the region), in training (noise drawn or passed in) and evaluation."""
    import torch._dynamo

    router = _dirmoe(**options)
    x = torch.randn(24, 32)
    for training, u_TE in ((True, None), (True, torch.rand(24, E)), (False, None)):
        router.train(training)
        explanation = torch._dynamo.explain(router.route_core)(x, u_TE)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def _ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic of two flat samples."""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    grid = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, grid, right=True) / a.numel()
    cdf_b = torch.searchsorted(b, grid, right=True) / b.numel()
    return float((cdf_a - cdf_b).abs().max())


@pytest.mark.slow
def test_compiled_region_matches_eager():
    """inductor (C++ backend here) against eager. At fixed noise (the gates' uniforms passed in, the same seed for
    the Dirichlet draw): same routing map, everything else within 1e-3 of each tensor's scale, gradients too; one
    region forward and one backward, no host sync; bit-identical with the metrics on. With inductor's own generator: other uniforms, the same
    distribution (KS statistic of the 32768 relaxed gates below 0.02; critical value at p = 0.001 is 0.015)."""
    if not blocks.inductor_available(torch.device("cpu"))[0]:
        pytest.skip("no C++ compiler for inductor on this machine")
    T = 4096
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(1))
    signal, u_TE = torch.randn(T, E), torch.rand(T, E)
    fixed, drawn = {}, {}
    for mode in ("never", "always"):
        router = _dirmoe(mode).train()
        router.collect_metrics = False
        _step(router, x, signal, u_TE)  # compiles forward and backward
        with OpCounter() as counter:
            fixed[mode] = _step(router, x, signal, u_TE)
        if mode == "always":
            assert counter.counts.regions == 2 and counter.counts.syncs == 0
            router.collect_metrics = True  # the same region: the metrics change nothing the training computes
            logged, grads, _, _, _ = _step(router, x, signal, u_TE)
            assert logged.metrics and torch.equal(logged.probs, fixed[mode][0].probs)
            assert all(torch.equal(grads[n], fixed[mode][1][n]) for n in grads)
            router.collect_metrics = False
        torch.manual_seed(11)
        core = dirmoe._compiled_route_core() if mode == "always" else dirmoe._route_core
        drawn[mode] = core(router, x, None)[3]  # the gates' uniforms drawn inside the region

    def close(a, b):
        a, b = a.detach(), b.detach()
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max().clamp_min(1e-12)))

    (out_c, grads_c, xg_c, _, _), (out_e, grads_e, xg_e, _, _) = fixed["always"], fixed["never"]
    assert torch.equal(out_c.routing_map, out_e.routing_map)
    close(out_c.probs, out_e.probs)
    assert out_c.aux_losses.keys() == out_e.aux_losses.keys()
    for name in out_e.aux_losses:
        close(out_c.aux_losses[name], out_e.aux_losses[name])
    assert grads_c.keys() == grads_e.keys() and all(g is not None for g in grads_e.values())
    for name in grads_e:
        close(grads_c[name], grads_e[name])
    close(xg_c, xg_e)

    gates_c, gates_e = drawn["always"]["gates_TE"], drawn["never"]["gates_TE"]
    assert not torch.allclose(gates_c, gates_e)  # inductor's generator, not the eager one
    assert _ks_statistic(gates_c, gates_e) < 0.02
    theta_c, theta_e = drawn["always"]["theta_TE"].mean(0), drawn["never"]["theta_TE"].mean(0)
    assert (theta_c - theta_e).abs().max() < 0.02


def test_auto_is_eager_on_the_cpu_without_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _dirmoe("auto").compiles_elementwise(torch.device("cpu"))
    assert caught == []


def test_cost_report_command_writes_its_table(tmp_path, capsys):
    """``python -m repro study router-costs`` on two routers: the three files, a row per pass, Switch the unit."""
    import json

    from repro.cli import main as cli_main

    assert cli_main(["study", "router-costs", "--router", "switch,dirmoe", "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"router_costs.md", "router_costs.csv", "router_costs.json"}
    rows = {(r["router"], r["pass"]): r for r in json.loads((tmp_path / "router_costs.json").read_text())["rows"]}
    assert set(rows) == {(r, p) for r in ("switch", "dirmoe") for p in ("fwd", "bwd", "fwd+bwd")}
    assert rows["switch", "fwd+bwd"]["x_switch"] == 1.0
    total, fwd, bwd = (rows["dirmoe", p] for p in ("fwd+bwd", "fwd", "bwd"))
    assert total["launches"] == fwd["launches"] + bwd["launches"] == total["outside"] + total["region_kernels"]
    assert total["syncs"] == 0 and total["regions"] == 0 and fwd["bytes_moved"] > 1024 * 128 * 4  # reads x at least
    assert cli_main(["study", "router-costs", "--router", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown run 'nope'" in capsys.readouterr().err


def test_no_command_writes_into_results_by_default():
    """The committed tables change only when a command is told to write there (--out): every default output
    directory of a command that writes tables is under runs/."""
    from repro.studies import router_costs as costs
    from repro.studies.ablation import AblationConfig
    from repro.studies.mini import MiniConfig

    defaults = [costs.DEFAULT_OUT, MiniConfig(runs=("switch",)).out_dir, AblationConfig(cells=("paper",)).out_dir]
    assert all(d.startswith("runs/") for d in defaults), defaults
