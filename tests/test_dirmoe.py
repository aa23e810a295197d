"""DirMoE: the paper's maths against Monte Carlo, the router's schedules, eval mode, dispatch and losses."""

from __future__ import annotations

import math

import pytest
import torch

import routers
import routers.dirmoe_blocks as blocks
from routers.base import RoutingKind
from routers.dirichlet import (
    alpha_ratio,
    dirichlet_kl,
    expected_simpson,
    lambda_for_mass_variance,
    lambda_for_simpson,
)
from routers.dirmoe import DirMoEConfig

HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 8, 1, 64


def build(seed: int = 0, **options) -> routers.Router:
    torch.manual_seed(seed)
    options.setdefault("top_k", TOP_K)
    return routers.build_router("dirmoe", hidden_size=HIDDEN, num_experts=EXPERTS, **options)


def inputs(seed: int = 0, tokens: int = TOKENS) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def dirichlet_samples(alpha: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.distributions.Dirichlet(alpha.double()).sample((n,))


def assert_mc_close(samples: torch.Tensor, expected: float, z: float = 4.5) -> None:
    """The sample mean is within z standard errors (plus a hair) of ``expected``."""
    mean = samples.mean().item()
    stderr = samples.std().item() / math.sqrt(samples.numel())
    assert abs(mean - expected) <= z * stderr + 1e-4, f"MC {mean:.5f} vs {expected:.5f} (stderr {stderr:.2e})"


# ----------------------------------------------------------------------------------------- paper maths
BETA = torch.tensor([2.0, 0.5, 1.0, 0.1, 3.0], dtype=torch.float64)


@pytest.mark.parametrize("lam", [0.3, 2.0, 10.0])
def test_lemma_expected_simpson_matches_monte_carlo(lam):
    p = dirichlet_samples(lam * BETA, 100_000, seed=1)
    assert_mc_close((p * p).sum(-1), expected_simpson(lam, BETA))


def test_theorem_monotone_decreasing_with_limits_1_and_sum_m_squared():
    m = BETA / BETA.sum()
    limit_inf = float((m * m).sum())
    grid = torch.logspace(-4, 4, 60).tolist()
    values = [expected_simpson(lam, BETA) for lam in grid]
    assert all(a > b for a, b in zip(values, values[1:])), "E[H] must decrease strictly in lambda"
    assert expected_simpson(1e-9, BETA) == pytest.approx(1.0, abs=1e-8)
    assert expected_simpson(1e9, BETA) == pytest.approx(limit_inf, abs=1e-8)
    # Monte Carlo: matches the Lemma along the way, decreasing, near 1 for small lambda and near sum m_i^2
    # for large lambda. (Much smaller lambdas underflow the Gamma draws even in float64: not a test of the maths.)
    mc = []
    for i, lam in enumerate([0.01, 0.5, 5.0, 1e4]):
        p = dirichlet_samples(lam * BETA, 40_000, seed=10 + i)
        h_N = (p * p).sum(-1)
        assert_mc_close(h_N, expected_simpson(lam, BETA))
        mc.append(h_N.mean().item())
    assert all(a > b for a, b in zip(mc, mc[1:])), mc
    assert mc[0] > 0.95
    assert mc[-1] == pytest.approx(limit_inf, abs=0.002)


@pytest.mark.parametrize("h", [0.2, 0.5, 0.8])
def test_symmetric_calibrator_hits_target_simpson(h):
    lam = lambda_for_simpson(h, EXPERTS)
    assert expected_simpson(lam, [1.0] * EXPERTS) == pytest.approx(h, rel=1e-12)
    p = dirichlet_samples(torch.full((EXPERTS,), lam), 100_000, seed=2)
    assert_mc_close((p * p).sum(-1), h)


@pytest.mark.parametrize("m, s, v_tar", [(0.85, 1, 0.01), (0.9, 2, 0.02)])
def test_two_group_calibrator_hits_target_variance_of_active_mass(m, s, v_tar):
    alpha_lo = 0.05
    alpha_hi = alpha_ratio(m, EXPERTS, s) * alpha_lo
    lam = lambda_for_mass_variance(m, v_tar, s, EXPERTS, alpha_hi, alpha_lo)
    beta = torch.tensor([alpha_hi] * s + [alpha_lo] * (EXPERTS - s))
    mass = dirichlet_samples(lam * beta, 200_000, seed=3)[:, :s].sum(-1)
    assert mass.mean().item() == pytest.approx(m, abs=0.003)
    # Var(T) = v_tar; the sample variance's relative error is ~ sqrt(2/N) * (kurtosis factor) << 4%.
    assert mass.var().item() == pytest.approx(v_tar, rel=0.04)


def test_dirichlet_kl_matches_torch_batched_and_differentiable():
    g = torch.Generator().manual_seed(4)
    alpha_q = (0.05 + 5 * torch.rand(4, 3, 6, generator=g)).requires_grad_(True)
    alpha_p = 0.05 + 5 * torch.rand(4, 3, 6, generator=g)
    ours = dirichlet_kl(alpha_q, alpha_p)
    ref = torch.distributions.kl_divergence(
        torch.distributions.Dirichlet(alpha_q), torch.distributions.Dirichlet(alpha_p)
    )
    assert ours.shape == (4, 3)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    ours.sum().backward()
    assert torch.isfinite(alpha_q.grad).all() and alpha_q.grad.abs().sum() > 0
    # Broadcast prior, and KL(q || q) = 0.
    shared_p = alpha_p[0, 0]
    torch.testing.assert_close(
        dirichlet_kl(alpha_q.detach(), shared_p),
        torch.distributions.kl_divergence(
            torch.distributions.Dirichlet(alpha_q.detach()), torch.distributions.Dirichlet(shared_p.expand(4, 3, 6))
        ),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(dirichlet_kl(alpha_p, alpha_p), torch.zeros(4, 3), rtol=0, atol=1e-5)


def _routing_sample_inputs(center_logits: bool = True, prior_alpha_hi: float = 0.8) -> tuple[tuple, dict]:
    """Float64 arguments of ``blocks.routing_sample`` (T=6, D=3, E=4, k=1): x, W, b first (the inputs that take
    gradients), then the noise and the schedule's scalars (tau, prior alpha_hi / alpha_lo, lambda_q, lambda_p)."""
    g = torch.Generator().manual_seed(5)
    E = 4
    tensors = [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)
               for shape in ((6, 3), (3 * E, 3), (3 * E,))]
    u_TE = torch.rand(6, E, generator=g, dtype=torch.float64)
    scalars = [torch.tensor(v, dtype=torch.float64) for v in (1.5, prior_alpha_hi, 0.2, 20.0, 0.5)]
    options = dict(num_experts=E, top_k=1, center_logits=center_logits, alpha_min=1e-3, normalized=False,
                   weight_leak=1e-3, sparsity_weight=0.3, kl_weight=0.7)
    return (*tensors, u_TE, *scalars), options


def _differentiable(args: tuple, options: dict):
    """``routing_sample``'s outputs that carry gradients: the routing weights, the sparsity and the KL terms."""
    out = blocks.routing_sample(*args, **options)
    return out[6], out[8], out[9]


@pytest.fixture
def mean_for_the_draw(monkeypatch):
    """The Dirichlet draw replaced by the posterior mean ``alpha / alpha_0``, and ``torch._dirichlet_grad`` by
    ``1 / alpha_0``: the draw's backward ``grad (g - <g, theta>)`` is then the mean's exact vector-Jacobian product,
    so finite differences check the whole closed-form backward (the draw's own gradient is torch's)."""
    monkeypatch.setattr(torch, "_sample_dirichlet", lambda alpha: alpha / alpha.sum(-1, keepdim=True))
    monkeypatch.setattr(torch, "_dirichlet_grad", lambda theta, alpha, total: (1.0 / total).expand_as(theta))


@pytest.mark.parametrize("center_logits", [True, False])
def test_routing_sample_closed_form_backward_passes_gradcheck(mean_for_the_draw, center_logits):
    # The prior is built on sg(z~), which finite differences do not see: a flat prior (alpha_hi = alpha_lo) here.
    args, options = _routing_sample_inputs(center_logits, prior_alpha_hi=0.2)
    assert torch.autograd.gradcheck(lambda *xwb: _differentiable((*xwb, *args[3:]), options), args[:3])


@pytest.mark.parametrize("sabotage", ["trigamma", "draw"])
def test_gradcheck_catches_a_wrong_term_of_the_closed_form_backward(mean_for_the_draw, monkeypatch, sabotage):
    """The check above can fail: 1% off in the KL's trigamma, or in the draw's gradient, and gradcheck says so."""
    if sabotage == "trigamma":
        polygamma = torch.polygamma
        monkeypatch.setattr(torch, "polygamma", lambda n, t: 1.01 * polygamma(n, t))
    else:
        monkeypatch.setattr(torch, "_dirichlet_grad", lambda theta, alpha, total: (1.01 / total).expand_as(theta))
    args, options = _routing_sample_inputs(prior_alpha_hi=0.2)
    fn = lambda *xwb: _differentiable((*xwb, *args[3:]), options)  # noqa: E731
    assert not torch.autograd.gradcheck(fn, args[:3], raise_exception=False)


@pytest.mark.parametrize("center_logits", [True, False])
def test_routing_sample_closed_form_matches_the_expression_through_autograd(monkeypatch, center_logits):
    """With torch's Dirichlet draw (the same seed): every output bit-identical to the expression's, and the gradients
    of x, W and b through any of the differentiable outputs alone or all together equal autograd's."""
    args, options = _routing_sample_inputs(center_logits)
    cotangents = [torch.randn(6, 4, dtype=torch.float64), torch.tensor(1.3, dtype=torch.float64),
                  torch.tensor(-0.6, dtype=torch.float64)]
    results = {}
    for path in ("closed form", "autograd"):
        with monkeypatch.context() as m:
            if path == "autograd":  # the expression: what the compiled region runs
                m.setattr(torch.compiler, "is_compiling", lambda: True)
            torch.manual_seed(3)
            out = blocks.routing_sample(*args, **options)
        weights_sparsity_kl = out[6], out[8], out[9]
        grads = [torch.autograd.grad([weights_sparsity_kl[i] for i in picked], args[:3],
                                     [cotangents[i] for i in picked], retain_graph=True)
                 for picked in ((0,), (1,), (2,), (0, 1, 2))]
        results[path] = out, grads
    (ours, our_grads), (ref, ref_grads) = results["closed form"], results["autograd"]
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(ours, ref))
    for mine, theirs in zip(our_grads, ref_grads):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_alpha_ratio_and_the_two_readings_of_the_hyperparameter_table():
    assert round(alpha_ratio(0.85, 8, 1), 2) == 39.67
    ratio = DirMoEConfig(hidden_size=HIDDEN, num_experts=8, top_k=1).prior_constants()
    assert (ratio.mass, ratio.alpha_lo_init, ratio.alpha_floor) == (0.85, 0.05, 0.005)
    assert round(ratio.ratio, 2) == 39.67 and round(ratio.alpha_hi_init, 2) == 1.98
    literal = DirMoEConfig(hidden_size=HIDDEN, num_experts=8, top_k=1, hparam_reading="literal").prior_constants()
    assert (literal.mass, literal.alpha_lo_init, literal.alpha_floor) == (0.9, 0.005, 0.005)
    assert literal.ratio == pytest.approx(63.0)
    override = DirMoEConfig(hidden_size=HIDDEN, num_experts=8, prior_mass=0.9).prior_constants()
    assert override.ratio == pytest.approx(63.0) and override.alpha_lo_init == 0.05


BETA_OK = [1.0, 2.0]
INVALID_CALLS = [
    # h outside (1/E, 1), E < 2
    ("h ", lambda: lambda_for_simpson(1 / 8, 8)),
    ("h ", lambda: lambda_for_simpson(1.0, 8)),
    ("h ", lambda: lambda_for_simpson(0.05, 8)),
    ("h ", lambda: lambda_for_simpson(1.5, 8)),
    ("num_experts", lambda: lambda_for_simpson(0.5, 1)),
    # m outside (0, 1)
    ("m ", lambda: alpha_ratio(0.0, 8, 1)),
    ("m ", lambda: alpha_ratio(1.0, 8, 1)),
    ("m ", lambda: lambda_for_mass_variance(1.2, 0.01, 1, 8, 2.0, 0.05)),
    # k >= E or k < 1
    ("k ", lambda: alpha_ratio(0.85, 8, 8)),
    ("k ", lambda: alpha_ratio(0.85, 8, 0)),
    ("s ", lambda: lambda_for_mass_variance(0.85, 0.01, 8, 8, 2.0, 0.05)),
    ("s ", lambda: lambda_for_mass_variance(0.85, 0.01, 0, 8, 2.0, 0.05)),
    # v_tar >= m(1-m) or <= 0
    ("v_tar", lambda: lambda_for_mass_variance(0.85, 0.85 * (1 - 0.85), 1, 8, 0.05 * 39.666666, 0.05)),
    ("v_tar", lambda: lambda_for_mass_variance(0.85, 0.2, 1, 8, 0.05 * 39.666666, 0.05)),
    ("v_tar", lambda: lambda_for_mass_variance(0.85, 0.0, 1, 8, 0.05 * 39.666666, 0.05)),
    ("v_tar", lambda: lambda_for_mass_variance(0.85, -0.01, 1, 8, 0.05 * 39.666666, 0.05)),
    # non-positive alphas / lambda
    ("alpha_hi", lambda: lambda_for_mass_variance(0.85, 0.01, 1, 8, 0.0, 0.05)),
    ("alpha_lo", lambda: lambda_for_mass_variance(0.85, 0.01, 1, 8, 2.0, -0.05)),
    ("does not match", lambda: lambda_for_mass_variance(0.9, 0.01, 1, 8, 0.05 * 39.666666, 0.05)),
    ("lam", lambda: expected_simpson(0.0, BETA_OK)),
    ("lam", lambda: expected_simpson(-1.0, BETA_OK)),
    ("beta", lambda: expected_simpson(1.0, [1.0, 0.0])),
    ("beta", lambda: expected_simpson(1.0, [1.0, -2.0])),
    ("beta", lambda: expected_simpson(1.0, [])),
    ("alpha_q", lambda: dirichlet_kl(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))),
    ("alpha_p", lambda: dirichlet_kl(torch.tensor([1.0, 1.0]), torch.tensor([-1.0, 1.0]))),
    ("broadcast", lambda: dirichlet_kl(torch.ones(3, 4), torch.ones(2, 4))),
]


@pytest.mark.parametrize(
    "match, call", INVALID_CALLS, ids=[f"{i}-{m.strip()}" for i, (m, _) in enumerate(INVALID_CALLS)]
)
def test_invalid_arguments_raise_value_error(match, call):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "options, field",
    [
        ({"top_k": EXPERTS}, "top_k"),
        ({"tau_schedule": "linear"}, "tau_schedule"),
        ({"tau_end": 3.0}, "tau_end"),
        ({"lambda_q": 0.0}, "lambda_q"),
        ({"hparam_reading": "other"}, "hparam_reading"),
        ({"alpha_floor": 0.1}, "alpha_floor"),
        ({"prior_mass": 0.1}, "prior_mass"),
        ({"alpha_decay": 1.5}, "alpha_decay"),
        ({"schedule_steps": 0}, "schedule_steps"),
        ({"dispatch": "all"}, "dispatch"),
        ({"z_threshold": 1.0}, "z_threshold"),
        ({"max_experts_per_token": EXPERTS + 1}, "max_experts_per_token"),
        ({"recon_reduction": "max"}, "recon_reduction"),
        ({"kl_weight": -1.0}, "kl_weight"),
        ({"detach_recon_target": "yes"}, "detach_recon_target"),
        ({"gate_bias_init": "zero"}, "gate_bias_init"),
        ({"tau_schedule_steps": 0}, "tau_schedule_steps"),
        ({"posterior_scale": "fixed"}, "posterior_scale"),
        ({"dense_steps": -1}, "dense_steps"),
        ({"dense_steps": 1.5}, "dense_steps"),
        ({"recon_weight": -0.1}, "recon_weight"),
        ({"recon_target": "mean"}, "recon_target"),
        ({"recon_mean_momentum": 1.5}, "recon_mean_momentum"),
        ({"balance_loss_coeff": float("nan")}, "balance_loss_coeff"),
    ],
)
def test_invalid_config_names_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        build(**options)


# ---------------------------------------------------------------------------------------------- router
def _logit(p: float) -> float:
    return math.log(p / (1 - p))


@pytest.mark.parametrize("num_experts, top_k", [(8, 1), (16, 2), (4, 3)])
def test_tempered_gate_bias_sets_the_noise_free_gate_and_posterior_bases(num_experts, top_k):
    torch.manual_seed(0)
    router = routers.build_router("dirmoe", hidden_size=HIDDEN, num_experts=num_experts, top_k=top_k)
    # The paper's init b = tau_0 logit(k/E): the noise-free relaxed gate sigmoid(b / tau_0) is k/E.
    torch.testing.assert_close(router.bias[:num_experts], torch.full((num_experts,), 2.0 * _logit(top_k / num_experts)))
    rate = torch.sigmoid(router.bias[:num_experts] / router.config.tau_start)
    torch.testing.assert_close(rate, torch.full((num_experts,), top_k / num_experts))
    # Centering removes only the x-dependent part: the logits' per-token mean is the bias' mean.
    sample = router.sample(inputs())
    torch.testing.assert_close(sample.logits_TE.mean(-1), router.bias[:num_experts].mean().expand(TOKENS))
    # The posterior bases start at the prior's alpha_hi^(0) / alpha_lo^(0).
    prior = router.config.prior_constants()
    E = num_experts
    alpha_min = router.config.posterior_alpha_min
    softplus = torch.nn.functional.softplus
    assert softplus(router.bias[E]).item() + alpha_min == pytest.approx(prior.alpha_hi_init, rel=1e-5)
    assert softplus(router.bias[2 * E]).item() + alpha_min == pytest.approx(prior.alpha_lo_init, rel=1e-5)


@pytest.mark.parametrize("init", ["tempered", "inclusion"])
@pytest.mark.parametrize("z_threshold", [0.5, 0.125])
def test_gate_bias_init_selection_rate_and_fallback_share_at_step_zero(init, z_threshold):
    """P(z~_i >= c) = sigmoid(b - tau_0 logit(c)); "inclusion" makes it k/E. Monte Carlo over 20k tokens."""
    tokens = 20_000
    router = build(gate_bias_init=init, z_threshold=z_threshold, max_experts_per_token=EXPERTS).train()
    with torch.no_grad():
        router.weight.zero_()  # no x-dependent part: every token's logits are the bias
    router.set_step(0)
    tau0, pi = router.config.tau_start, TOP_K / EXPERTS
    if init == "tempered":
        expected_p = torch.sigmoid(torch.tensor(tau0 * _logit(pi) - tau0 * _logit(z_threshold))).item()
    else:
        expected_p = pi
    torch.manual_seed(1)
    out = router(inputs(tokens=tokens))
    torch.manual_seed(1)
    with torch.no_grad():
        gates_TE = router.sample(inputs(tokens=tokens)).gates_TE
    assert_mc_close((gates_TE >= z_threshold).double(), expected_p)
    expected_fallback = (1 - expected_p) ** EXPERTS
    stderr = math.sqrt(expected_fallback * (1 - expected_fallback) / tokens)
    assert abs(out.metrics["fallback_share"].item() - expected_fallback) < 4.5 * stderr
    if init == "tempered" and z_threshold == 0.5:
        # The documented number: ~85% of tokens are dispatched by the arg-max fallback at step 0 (E=8, k=1).
        assert round(expected_p, 3) == 0.020 and round(expected_fallback, 2) == 0.85
    if init == "inclusion":
        assert router.initial_gate_bias() == pytest.approx(_logit(pi) + tau0 * _logit(z_threshold))
        # k experts above the threshold per token in expectation.
        assert_mc_close((gates_TE >= z_threshold).double().sum(-1), TOP_K * 1.0)


def test_fallback_share_on_a_constructed_case():
    """Eval mode, logits = +-5 set by hand: tokens with every logit negative have no gate >= 1/2."""
    E, T = EXPERTS, 10
    router = build(center_logits=False).eval()
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:E, :E] = torch.eye(E)  # gate logits = x[:, :E]
        router.bias[:E].zero_()
    x_TD = torch.zeros(T, HIDDEN)
    x_TD[:, :E] = -5.0
    x_TD[0, 3] = x_TD[1, 5] = x_TD[2, 0] = x_TD[2, 6] = 5.0  # 3 tokens with selected experts, 7 with none
    with torch.no_grad():
        out = router(x_TD)
        r_TE = router.sample(x_TD).weights_TE
    assert out.metrics["fallback_share"].item() == pytest.approx(0.7)
    # The 7 fallback tokens go to their arg-max of r alone; the others to their selected experts.
    fallback_T = torch.arange(T) >= 3
    assert (out.routing_map[fallback_T].sum(-1) == 1).all()
    assert out.routing_map[fallback_T, r_TE[fallback_T].argmax(-1)].all()
    assert out.routing_map[0, 3] and out.routing_map[1, 5] and out.routing_map[2, [0, 6]].all()
    assert out.metrics["active_experts"].item() == pytest.approx((1 + 1 + 2 + 7) / T)
    # Rules without a fallback report 0.
    for options in ({"dispatch": "topk"}, {"dispatch": "dense"}):
        other = build(center_logits=False, **options).eval()
        other.load_state_dict(router.state_dict())
        with torch.no_grad():
            assert other(x_TD).metrics["fallback_share"].item() == 0.0


@pytest.mark.parametrize("schedule", ["cosine", "exponential"])
def test_schedules_hit_their_endpoints_and_restore_from_state_dict(schedule):
    steps = 50
    router = build(tau_schedule=schedule, lambda_p_schedule=schedule, schedule_steps=steps)
    expected = {
        0: {"tau": 2.0, "lambda_p": 0.5, "alpha_lo": 0.05, "alpha_hi": 0.05 * 119 / 3},
        steps: {"tau": 0.3, "lambda_p": 0.3, "alpha_lo": 0.005, "alpha_hi": 0.005 * 119 / 3},
        3 * steps: {"tau": 0.3, "lambda_p": 0.3, "alpha_lo": 0.005, "alpha_hi": 0.005 * 119 / 3},
    }
    for step, values in expected.items():
        router.set_step(step)
        got = router.schedule_values()
        for key, value in values.items():
            assert got[key].dtype == torch.float32
            assert got[key].item() == pytest.approx(value, rel=1e-5), (step, key)
    previous = None
    for step in range(0, steps + 1, 5):
        router.set_step(step)
        now = router.schedule_values()
        if previous is not None:
            assert all(now[k] <= previous[k] for k in now), step
        previous = now
    router.set_step(17)
    restored = build(seed=5, tau_schedule=schedule, lambda_p_schedule=schedule, schedule_steps=steps)
    restored.load_state_dict(router.state_dict())
    for key, value in router.schedule_values().items():
        assert torch.equal(restored.schedule_values()[key], value), key


def test_literal_reading_keeps_alpha_lo_at_the_floor():
    router = build(hparam_reading="literal", schedule_steps=10)
    for step in (0, 5, 10, 100):
        router.set_step(step)
        assert router.schedule_values()["alpha_lo"].item() == pytest.approx(0.005)


def test_eval_mode_is_deterministic_and_uses_the_posterior_mean():
    router = build().eval()
    router.set_step(123)
    x = inputs()
    with torch.no_grad():
        torch.manual_seed(1)
        a = router.sample(x)
        out_a = router(x)
        torch.manual_seed(2)
        b = router.sample(x)
        out_b = router(x)
    for name in ("gates_TE", "theta_TE", "weights_TE"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(out_a.probs, out_b.probs) and torch.equal(out_a.routing_map, out_b.routing_map)
    torch.testing.assert_close(a.theta_TE, a.alpha_q_TE / a.alpha_q_TE.sum(-1, keepdim=True), rtol=0, atol=0)
    torch.testing.assert_close(a.gates_TE, torch.sigmoid(a.logits_TE / a.schedule["tau"]), rtol=0, atol=0)
    # Training mode is stochastic (logistic noise and a Dirichlet draw).
    router.train()
    torch.manual_seed(1)
    c = router.sample(x)
    torch.manual_seed(2)
    d = router.sample(x)
    assert not torch.equal(c.gates_TE, d.gates_TE) and not torch.equal(c.theta_TE, d.theta_TE)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"z_threshold": 0.125, "max_experts_per_token": 3},
        {"z_threshold": 0.125, "top_k": 2, "max_experts_per_token": None},
        {"dispatch": "topk", "top_k": 2},
        {"renormalize": True},
        {"dispatch": "topk", "renormalize": True},
    ],
)
@pytest.mark.parametrize("training", [True, False])
def test_dispatch_rule_constraint_and_dropped_mass(options, training):
    router = build(**options).train(training)
    router.set_step(0)
    x = inputs(tokens=256)
    torch.manual_seed(0)
    with torch.no_grad():
        sample = router.sample(x)
    torch.manual_seed(0)
    out = router(x)
    c = router.config
    constraint = router.constraint
    constraint.check(out.routing_map)
    assert (out.probs[~out.routing_map] == 0).all()
    r_TE = sample.weights_TE
    kept_T = (r_TE * out.routing_map).sum(-1)
    torch.testing.assert_close(out.metrics["dropped_mass"], (1 - kept_T).mean())
    if c.renormalize:
        assert constraint.probs_sum_to_one
        torch.testing.assert_close(out.probs.sum(-1), torch.ones(256))
    else:
        torch.testing.assert_close(out.probs, r_TE * out.routing_map, rtol=0, atol=0)
        torch.testing.assert_close(out.metrics["dropped_mass"], 1 - out.probs.sum(-1).mean())
    top_T = r_TE.argmax(-1)
    assert out.routing_map[torch.arange(256), top_T].all(), "the highest-weighted expert must be dispatched"
    if c.dispatch == "topk":
        assert constraint.kind is RoutingKind.EXACT_K
        assert constraint.min_experts_per_token == constraint.max_experts_per_token == c.top_k
        top_k_TE = torch.zeros_like(r_TE).scatter(-1, r_TE.topk(c.top_k).indices, 1.0)
        torch.testing.assert_close(out.routing_map.float(), top_k_TE)
    else:
        cap = c.dispatch_cap()
        assert constraint.kind is RoutingKind.VARIABLE
        assert (constraint.min_experts_per_token, constraint.max_experts_per_token) == (1, cap)
        above_TE = sample.gates_TE >= c.z_threshold
        # Dispatched experts are above the threshold (or the forced top expert) ...
        forced_TE = torch.zeros_like(above_TE).scatter(-1, top_T[:, None], True)
        assert not (out.routing_map & ~(above_TE | forced_TE)).any()
        # ... and every above-threshold expert is dispatched unless the cap is full, which keeps the highest r.
        full_T = out.routing_map.sum(-1) == cap
        assert (out.routing_map | ~above_TE | full_T[:, None]).all()
        ranked_TE = torch.where(above_TE | forced_TE, r_TE, -1.0)
        top_TE = torch.zeros_like(above_TE).scatter(-1, ranked_TE.topk(cap).indices, True)
        assert torch.equal(out.routing_map, top_TE & (above_TE | forced_TE))
    if c.z_threshold == 0.125 and training:
        assert int(out.routing_map.sum(-1).max()) == c.dispatch_cap(), "the cap should bite at tau=2 with 0.125"


def test_sparsity_penalty_alone_drives_expected_active_count_to_k():
    router = build(sparsity_weight=1.0).train()
    with torch.no_grad():
        router.bias[:EXPERTS].zero_()  # every gate starts at sigmoid(g/tau): ~E/2 = 4 expected actives
    x = inputs(tokens=256)
    opt = torch.optim.Adam(router.parameters(), lr=0.05)
    history = []
    for _ in range(300):
        out = router(x)
        opt.zero_grad()
        out.aux_losses["dirmoe_sparsity"].backward()
        opt.step()
        history.append(out.metrics["expected_active"].item())
    assert history[0] > TOP_K + 2.0
    assert sum(history[-50:]) / 50 == pytest.approx(TOP_K, abs=0.3)


def test_losses_are_weighted_and_reductions_differ_by_hidden_size():
    x = inputs()
    outs = {}
    for reduction in ("mean", "sum"):
        router = build(seed=0, recon_reduction=reduction, kl_weight=0.5, sparsity_weight=0.25)
        torch.manual_seed(0)
        outs[reduction] = router(x)
    mean, total = outs["mean"], outs["sum"]
    torch.testing.assert_close(total.aux_losses["dirmoe_recon"], HIDDEN * mean.aux_losses["dirmoe_recon"])
    torch.testing.assert_close(mean.aux_losses["dirmoe_kl"], 0.5 * mean.metrics["kl"])
    torch.testing.assert_close(mean.aux_losses["dirmoe_sparsity"], 0.25 * mean.metrics["sparsity"])
    expected = {"expected_active", "dropped_mass", "kl", "recon", "tau", "lambda_p", "alpha_lo"}
    expected |= {"simpson_r", "simpson_theta", "simpson_theta_expected", "simpson_theta_target"}
    expected |= {"simpson_theta_target_gates", "fallback_share", "dense_phase", "input_mean_energy"}
    expected |= {"decoder_mean_alignment", "balance_loss", "load_share", "weight_share", "tokens_per_expert"}
    expected |= {"lambda_q", "posterior_total", "prior_total", "load_imbalance", "active_experts"}
    assert expected <= set(mean.metrics)
    assert all(not v.requires_grad for v in mean.metrics.values())


@pytest.mark.parametrize("detach", [True, False])
def test_reconstruction_target_detach_option(detach):
    router = build(detach_recon_target=detach)
    x = inputs().requires_grad_(True)
    torch.manual_seed(0)
    out = router(x)
    (grad_x,) = torch.autograd.grad(out.aux_losses["dirmoe_recon"], x)
    # With the target attached, d recon / d x contains the direct term (x - x_hat) / (D sigma^2).
    torch.manual_seed(0)
    sample = router.sample(x)
    direct_TD = (x - router.decoder(sample.weights_TE)) / (HIDDEN * TOKENS)
    through_encoder_TD = grad_x - (0 if detach else direct_TD)
    # The encoder path alone is small (init std 0.01); the direct path dominates when attached.
    assert through_encoder_TD.abs().max() < 0.1 * direct_TD.abs().max()


def test_float32_maths_under_bf16_inputs_and_parameters():
    router = build().to(torch.bfloat16)
    out = router(inputs().to(torch.bfloat16))
    assert out.probs.dtype == torch.float32 and torch.isfinite(out.probs).all()
    assert all(v.dtype == torch.float32 for v in out.aux_losses.values())


def test_registered_with_its_config_class():
    assert "dirmoe" in routers.available_routers()
    assert routers.router_class("dirmoe").Config is DirMoEConfig
    assert "dispatch" in routers.router_class("dirmoe").Config.option_names()


@pytest.mark.parametrize(
    "options",
    [
        {"decoder_hidden_size": 8},
        {"tau_schedule": "exponential", "lambda_p_schedule": "exponential", "tau_decay": 0.99},
        {"hparam_reading": "literal", "center_logits": False},
        {"recon_reduction": "sum", "detach_recon_target": False, "dispatch": "topk"},
        {"dispatch": "dense", "gate_bias_init": "inclusion"},
        {"dense_steps": 10, "balance_loss_coeff": 0.01},
        {"posterior_scale": "tied"},
        {"posterior_scale": "prior_matched", "tau_schedule_steps": 3},
        {"posterior_scale": "normalized", "recon_target": "centered", "detach_recon_target": False},
        {"recon_target": "data_mean", "decoder_hidden_size": 8},
    ],
)
def test_option_variants_train_with_finite_gradients_everywhere(options):
    router = build(**options).train()
    router.set_step(7)
    out = router(inputs())
    signal_TE = torch.randn_like(out.probs)
    ((out.probs * signal_TE).sum() + out.total_aux_loss()).backward()
    for name, p in router.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# ------------------------------------------------------------------------------- dispatch: dense
@pytest.mark.parametrize("training", [True, False])
def test_dense_dispatch_sends_every_token_to_every_expert_with_r(training):
    router = build(dispatch="dense").train(training)
    x = inputs(tokens=128)
    torch.manual_seed(0)
    with torch.no_grad():
        r_TE = router.sample(x).weights_TE
    torch.manual_seed(0)
    out = router(x)
    constraint = router.constraint
    assert constraint.kind is RoutingKind.EXACT_K and constraint.probs_sum_to_one
    assert (constraint.min_experts_per_token, constraint.max_experts_per_token) == (EXPERTS, EXPERTS)
    constraint.check(out.routing_map)
    assert out.routing_map.all()
    torch.testing.assert_close(out.probs, r_TE, rtol=0, atol=0)  # the paper's y = sum_i r_i E_i(x)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(128))
    assert out.metrics["dropped_mass"].abs().item() < 1e-6
    assert out.metrics["dense_phase"].item() == 1.0 and out.metrics["fallback_share"].item() == 0.0


@pytest.mark.parametrize("rule", ["threshold", "topk"])
def test_dense_steps_switch_to_the_rule_at_exactly_step_n(rule):
    n = 5
    warm = build(seed=2, dispatch=rule, dense_steps=n).train()
    plain = build(seed=2, dispatch=rule).train()
    x = inputs(tokens=256)
    constraint = warm.constraint
    assert constraint.kind is RoutingKind.VARIABLE
    rule_min = TOP_K if rule == "topk" else 1
    assert (constraint.min_experts_per_token, constraint.max_experts_per_token) == (rule_min, EXPERTS)
    for step in (0, n - 1, n, n + 10):
        warm.set_step(step)
        plain.set_step(step)
        torch.manual_seed(step)
        out = warm(x)
        torch.manual_seed(step)
        ref = plain(x)
        constraint.check(out.routing_map)
        if step < n:
            assert out.routing_map.all() and out.metrics["dense_phase"].item() == 1.0, step
            assert out.metrics["fallback_share"].item() == 0.0
            torch.testing.assert_close(out.probs.sum(-1), torch.ones(256))
        else:
            assert out.metrics["dense_phase"].item() == 0.0, step
            assert torch.equal(out.routing_map, ref.routing_map), step
            torch.testing.assert_close(out.probs, ref.probs, rtol=0, atol=0)
            assert not out.routing_map.all()
            if rule == "threshold":
                assert out.metrics["fallback_share"] == ref.metrics["fallback_share"] > 0


# -------------------------------------------------------------------------- reconstruction target
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("target", ["raw", "centered"])
def test_reconstruction_loss_value_and_gradients_against_the_formula(reduction, target):
    T, D, sigma2 = 6, 5, 0.7
    g = torch.Generator().manual_seed(3)
    x_TD = (torch.randn(T, D, generator=g, dtype=torch.float64) + 2.0).requires_grad_(True)
    xhat_TD = torch.randn(T, D, generator=g, dtype=torch.float64).requires_grad_(True)
    loss = routers.dirichlet.reconstruction_loss(x_TD, xhat_TD, sigma2=sigma2, reduction=reduction, target=target)
    grad_x, grad_xhat = torch.autograd.grad(loss, (x_TD, xhat_TD))
    y_TD = x_TD.detach() - (x_TD.detach().mean(0) if target == "centered" else 0.0)
    e_TD = y_TD - xhat_TD.detach()
    scale = 1.0 / (T * (D if reduction == "mean" else 1) * sigma2)  # d/de of sum ||e||^2 / (2 sigma2 T [D])
    torch.testing.assert_close(loss.detach(), 0.5 * scale * e_TD.pow(2).sum())
    torch.testing.assert_close(grad_xhat, -scale * e_TD)
    # Through the centred target: d/dx_t = scale (e_t - mean_s e_s); for the raw target scale e_t.
    expected_x = scale * (e_TD - e_TD.mean(0)) if target == "centered" else scale * e_TD
    torch.testing.assert_close(grad_x, expected_x)
    if target == "centered":
        # Invariant to a shift shared by all tokens; raw is not.
        shifted = routers.dirichlet.reconstruction_loss(
            x_TD + 3.0, xhat_TD, sigma2=sigma2, reduction=reduction, target=target
        )
        torch.testing.assert_close(shifted, loss)


@pytest.mark.parametrize("target", ["raw", "centered"])
def test_router_reconstruction_term_is_the_formula_on_its_sample(target):
    router = build(recon_target=target, recon_weight=0.5, recon_sigma2=2.0).train()
    x = inputs() + 4.0 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(9))
    torch.manual_seed(0)
    out = router(x)
    torch.manual_seed(0)
    sample = router.sample(x)
    xhat = router.decoder(sample.weights_TE)
    y = x - x.mean(0) if target == "centered" else x
    expected = ((y - xhat).pow(2).mean(-1)).mean() / (2 * 2.0)
    torch.testing.assert_close(out.metrics["recon"], expected.detach())
    torch.testing.assert_close(out.aux_losses["dirmoe_recon"], 0.5 * expected)


def test_reconstruction_centred_target_gradient_reaches_the_decoder_as_the_formula():
    """d/dW of ||(x - mean x) - (W r + b)||^2 (mean over D, T) against autograd through the router."""
    router = build(recon_target="centered", kl_weight=0.0, sparsity_weight=0.0).train()
    x = inputs() + 3.0
    torch.manual_seed(0)
    out = router(x)
    out.aux_losses["dirmoe_recon"].backward()
    torch.manual_seed(0)
    with torch.no_grad():
        r_TE = router.sample(x).weights_TE
        layer = router.decoder.layers[0]
        e_TD = (x - x.mean(0)) - (r_TE @ layer.weight.t() + layer.bias)
        scale = 1.0 / (TOKENS * HIDDEN)
    torch.testing.assert_close(layer.weight.grad, -scale * e_TD.t() @ r_TE, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(layer.bias.grad, -scale * e_TD.sum(0), rtol=1e-4, atol=1e-7)


def test_data_mean_target_tracks_the_mean_and_reduces_to_its_limits():
    x1 = inputs(seed=1) + 2.0
    x2 = inputs(seed=2) - 1.0
    router = build(recon_target="data_mean", recon_mean_momentum=0.25).train()
    assert torch.equal(router.recon_mean_D, torch.zeros(HIDDEN))
    router(x1)
    torch.testing.assert_close(router.recon_mean_D, x1.mean(0))  # the first micro-batch sets it
    router(x2)
    torch.testing.assert_close(router.recon_mean_D, 0.75 * x1.mean(0) + 0.25 * x2.mean(0))
    assert int(router.recon_mean_updates) == 2
    before = router.recon_mean_D.clone()
    router.eval()
    with torch.no_grad():
        router(x1)
    assert torch.equal(router.recon_mean_D, before), "evaluation must not update the mean"
    # The offset is added to the decoder's output.
    router.train()
    torch.manual_seed(0)
    out = router(x2)
    mu = router.recon_mean_D.clone()
    torch.manual_seed(0)
    xhat = router.decoder(router.sample(x2).weights_TE) + mu
    torch.testing.assert_close(out.metrics["recon"], (x2 - xhat).pow(2).mean(-1).mean().detach() / 2)
    # Checkpoints carry the statistic; other targets have no such keys.
    restored = build(seed=4, recon_target="data_mean")
    restored.load_state_dict(router.state_dict())
    assert torch.equal(restored.recon_mean_D, router.recon_mean_D)
    assert "recon_mean_D" not in build().state_dict()
    # Momentum 1 is the centred target (in training); momentum 0 keeps the first batch's mean.
    centred = build(seed=5, recon_target="centered")
    every = build(seed=5, recon_target="data_mean", recon_mean_momentum=1.0)
    first_only = build(seed=5, recon_target="data_mean", recon_mean_momentum=0.0)
    for x in (x1, x2):
        torch.manual_seed(0)
        a = centred(x).metrics["recon"]
        torch.manual_seed(0)
        b = every(x).metrics["recon"]
        first_only(x)
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(first_only.recon_mean_D, x1.mean(0))


# ------------------------------------------------------------------------------- loss switches
def test_zero_weights_leave_their_terms_out_and_keep_the_metrics():
    router = build(recon_weight=0.0, kl_weight=0.0, sparsity_weight=0.0).train()
    out = router(inputs())
    assert out.aux_losses == {}
    assert {"recon", "kl", "sparsity"} <= set(out.metrics) and out.metrics["recon"] > 0
    only_recon = build(recon_weight=0.25, kl_weight=0.0, sparsity_weight=0.0).train()
    out = only_recon(inputs())
    assert set(out.aux_losses) == {"dirmoe_recon"}
    torch.testing.assert_close(out.aux_losses["dirmoe_recon"].detach(), 0.25 * out.metrics["recon"])
    # Without the reconstruction term the decoder gets no gradient; the heads still learn from the others.
    no_recon = build(recon_weight=0.0).train()
    out = no_recon(inputs())
    out.total_aux_loss().backward()
    assert all(p.grad is None for p in no_recon.decoder.parameters())
    assert no_recon.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------- Switch's balancing loss
@pytest.mark.parametrize("options", [{}, {"dispatch": "topk", "top_k": 2}, {"z_threshold": 0.125}])
def test_balance_loss_control_is_megatrons_switch_loss_on_r_and_the_map(options):
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    coeff = 0.03
    router = build(balance_loss_coeff=coeff, **options).train()
    k = router.config.top_k
    x = inputs(tokens=128)
    torch.manual_seed(0)
    out = router(x)
    torch.manual_seed(0)
    sample = router.sample(x)
    counts_E = out.routing_map.sum(0)
    expected = switch_load_balancing_loss_func(sample.weights_TE, counts_E, 128, k, EXPERTS, coeff)
    torch.testing.assert_close(out.aux_losses["load_balancing_loss"], expected, rtol=0, atol=0)
    # Switch's formula: coeff * E * sum_i f_i P_i, f_i = tokens_i / (k T), P_i = mean_t r_ti.
    f_E = counts_E.float() / (k * 128)
    P_E = sample.weights_TE.mean(0)
    torch.testing.assert_close(expected, coeff * EXPERTS * (f_E * P_E).sum())
    torch.testing.assert_close(out.metrics["balance_loss"], expected.detach() / coeff)
    # Its gradient reaches the gate and posterior heads through r.
    (grad,) = torch.autograd.grad(out.aux_losses["load_balancing_loss"], router.weight)
    assert grad.abs().sum() > 0
    # Not in evaluation, and off by default.
    with torch.no_grad():
        assert "load_balancing_loss" not in router.eval()(x).aux_losses
    assert "load_balancing_loss" not in build(**options).train()(x).aux_losses


# ---------------------------------------------------------------------------- posterior scale
def test_posterior_scale_options_against_their_formulas():
    x = inputs()
    torch.manual_seed(0)
    free = build(seed=3).train()
    tied = build(seed=3, posterior_scale="tied").train()
    normalized = build(seed=3, posterior_scale="normalized").train()
    for router in (free, tied, normalized):
        router.set_step(40)
    samples = {}
    for name, router in (("free", free), ("tied", tied), ("normalized", normalized)):
        torch.manual_seed(0)
        samples[name] = router.sample(x)
    f, t, n = samples["free"], samples["tied"], samples["normalized"]
    sched = f.schedule
    torch.testing.assert_close(t.gates_TE, f.gates_TE, rtol=0, atol=0)  # same noise, same heads
    torch.testing.assert_close(t.lambda_q, sched["lambda_p"])
    torch.testing.assert_close(t.alpha_q_TE, sched["lambda_p"] * f.base_q_TE)
    torch.testing.assert_close(f.alpha_q_TE, 20.0 * f.base_q_TE)
    # Normalized: the heads' shape, the prior's base total at the same gates, times lambda_q.
    prior_total_T = (f.gates_TE * sched["alpha_hi"] + (1 - f.gates_TE) * sched["alpha_lo"]).sum(-1)
    torch.testing.assert_close(n.alpha_q_TE.sum(-1), 20.0 * prior_total_T)
    torch.testing.assert_close(
        n.alpha_q_TE / n.alpha_q_TE.sum(-1, keepdim=True), f.alpha_q_TE / f.alpha_q_TE.sum(-1, keepdim=True)
    )
    # Prior matched: the prior at lambda_q's scale, lambda_p's schedule kept as a relative decay.
    pm = build(seed=3, posterior_scale="prior_matched").train()
    pm.set_step(40)
    torch.manual_seed(0)
    p = pm.sample(x)
    torch.testing.assert_close(p.alpha_q_TE, f.alpha_q_TE)
    torch.testing.assert_close(p.alpha_p_TE, f.alpha_p_TE * (20.0 / 0.5))
    # At step 0 with no x-dependent part the heads are the prior's bases: normalized equals free.
    a, b = build(seed=3).train(), build(seed=3, posterior_scale="normalized").train()
    with torch.no_grad():
        a.weight.zero_(), b.weight.zero_()
    torch.manual_seed(1)
    sa = a.sample(x)
    torch.manual_seed(1)
    sb = b.sample(x)
    torch.testing.assert_close(sb.alpha_q_TE, sa.alpha_q_TE, rtol=1e-5, atol=1e-6)


def test_what_the_kl_does_to_the_posterior_under_each_scale_option():
    """The heads trained on the KL alone (fixed batch, Adam lr 0.05, 120 steps), per ``posterior_scale``.

    free: the heads absorb the lambda_q / lambda_p = 40x gap and theta gets sparser than the calibrated
    target; normalized: the total cannot move, so the KL sharpens the shape instead; tied and prior_matched:
    the KL's optimum is the calibrated posterior, so nothing moves.
    """
    results = {}
    for scale in ("free", "normalized", "tied", "prior_matched"):
        router = build(posterior_scale=scale, kl_weight=1.0, recon_weight=0.0, sparsity_weight=0.0).train()
        opt = torch.optim.Adam([router.weight, router.bias], lr=0.05)
        x = inputs(tokens=128)
        ratios = []
        for _ in range(120):
            out = router(x)
            opt.zero_grad()
            out.aux_losses["dirmoe_kl"].backward()
            opt.step()
            ratios.append((out.metrics["posterior_total"] / out.metrics["prior_total"]).item())
        m = out.metrics
        h, target = m["simpson_theta_expected"].item(), m["simpson_theta_target_gates"].item()
        results[scale] = (ratios[0], ratios[-1], h, target)
    first, last, h, target = results["free"]
    assert first == pytest.approx(40.0, rel=0.01) and last < 2.0, results
    assert h > target + 0.1, results
    first, last, h, target = results["normalized"]
    assert first == pytest.approx(40.0, rel=1e-4) and last == pytest.approx(40.0, rel=1e-4), results
    assert h > target + 0.2, results
    for scale in ("tied", "prior_matched"):
        first, last, h, target = results[scale]
        assert first == pytest.approx(1.0, abs=0.05) and last == pytest.approx(1.0, abs=0.05), (scale, results)
        assert h == pytest.approx(target, abs=0.02), (scale, results)


# ------------------------------------------------------------------------------------ metrics
def test_dirichlet_expected_simpson_is_the_lemma_per_row():
    g = torch.Generator().manual_seed(5)
    alpha_RE = 0.01 + 3 * torch.rand(7, EXPERTS, generator=g, dtype=torch.float64)
    got_R = routers.dirichlet.dirichlet_expected_simpson(alpha_RE)
    for row, value in zip(alpha_RE, got_R):
        assert value.item() == pytest.approx(expected_simpson(1.0, row), rel=1e-12)
        assert value.item() == pytest.approx(expected_simpson(2.5, row / 2.5), rel=1e-12)


@pytest.mark.parametrize("scale", ["free", "tied", "prior_matched", "normalized"])
@pytest.mark.parametrize("step", [0, 10_000])
def test_simpson_targets_follow_the_lemma_with_the_scale_in_use(scale, step):
    router = build(posterior_scale=scale).train()
    router.set_step(step)
    x = inputs()
    torch.manual_seed(0)
    out = router(x)
    torch.manual_seed(0)
    s = router.sample(x)
    sched = s.schedule
    lam = sched["lambda_p"].item() if scale == "tied" else 20.0
    a_hi, a_lo = sched["alpha_hi"].item(), sched["alpha_lo"].item()
    beta = [a_hi] * TOP_K + [a_lo] * (EXPERTS - TOP_K)
    assert out.metrics["simpson_theta_target"].item() == pytest.approx(expected_simpson(lam, beta), rel=1e-5)
    assert out.metrics["lambda_q"].item() == pytest.approx(lam, rel=1e-6)
    per_token = [expected_simpson(lam, (z * a_hi + (1 - z) * a_lo).tolist()) for z in s.gates_TE.detach().double()]
    assert out.metrics["simpson_theta_target_gates"].item() == pytest.approx(sum(per_token) / TOKENS, rel=1e-4)
    per_token_q = [expected_simpson(1.0, a.tolist()) for a in s.alpha_q_TE.detach().double()]
    assert out.metrics["simpson_theta_expected"].item() == pytest.approx(sum(per_token_q) / TOKENS, rel=1e-4)
    torch.testing.assert_close(out.metrics["posterior_total"], s.alpha_q_TE.detach().sum(-1).mean())
    torch.testing.assert_close(out.metrics["prior_total"], s.alpha_p_TE.sum(-1).mean())


def test_input_mean_energy_and_decoder_alignment_on_constructed_inputs():
    router = build().train()
    g = torch.Generator().manual_seed(6)
    mean_D = torch.randn(HIDDEN, generator=g)
    noise_TD = torch.randn(TOKENS, HIDDEN, generator=g)
    x = mean_D + noise_TD
    out = router(x)
    expected = x.mean(0).pow(2).sum() / x.pow(2).sum(-1).mean()
    torch.testing.assert_close(out.metrics["input_mean_energy"], expected)
    assert router(mean_D.expand(TOKENS, HIDDEN).clone()).metrics["input_mean_energy"].item() == pytest.approx(1.0)
    assert router(torch.cat([noise_TD, -noise_TD])).metrics["input_mean_energy"].item() == pytest.approx(0.0, abs=1e-6)
    # Linear decoder: the directions are its weight's columns; alignment = mean cosine with the batch mean.
    layer = router.decoder.layers[0]
    torch.testing.assert_close(router.decoder_directions(), layer.weight.detach().t())
    cos = torch.nn.functional.cosine_similarity(layer.weight.detach().t(), x.mean(0).expand(EXPERTS, HIDDEN), dim=-1)
    torch.testing.assert_close(out.metrics["decoder_mean_alignment"], cos.mean())
    with torch.no_grad():
        # Every column along the mean (positive multiples).
        layer.weight.copy_(torch.rand(EXPERTS, generator=g)[None, :] * x.mean(0)[:, None])
        layer.bias.normal_()  # the bias is not part of a column
    assert router(x).metrics["decoder_mean_alignment"].item() == pytest.approx(1.0, abs=1e-5)
    with torch.no_grad():
        layer.weight.neg_()
    assert router(x).metrics["decoder_mean_alignment"].item() == pytest.approx(-1.0, abs=1e-5)


def test_per_expert_load_and_weight_shares():
    router = build(z_threshold=0.125).train()
    x = inputs(tokens=256)
    torch.manual_seed(0)
    out = router(x)
    torch.manual_seed(0)
    r_TE = router.sample(x).weights_TE.detach()
    counts_E = out.routing_map.sum(0).float()
    assert out.metrics["tokens_per_expert"].shape == out.metrics["load_share"].shape == (EXPERTS,)
    torch.testing.assert_close(out.metrics["tokens_per_expert"], counts_E)
    torch.testing.assert_close(out.metrics["load_share"], counts_E / counts_E.sum())
    torch.testing.assert_close(out.metrics["weight_share"], r_TE.mean(0))
    torch.testing.assert_close(out.metrics["load_imbalance"], counts_E.max() / counts_E.mean())


def test_short_tau_horizon_anneals_tau_alone():
    router = build(schedule_steps=100, tau_schedule_steps=10)
    router.set_step(10)
    values = router.schedule_values()
    assert values["tau"].item() == pytest.approx(0.3, rel=1e-6)
    assert values["lambda_p"].item() == pytest.approx(0.3 + 0.2 * 0.5 * (1 + math.cos(math.pi * 0.1)), rel=1e-6)
    router.set_step(5)
    assert router.schedule_values()["tau"].item() == pytest.approx(1.15, rel=1e-6)  # cosine midpoint
    exp = build(schedule_steps=100, tau_schedule_steps=10, tau_schedule="exponential")
    exp.set_step(10)
    assert exp.schedule_values()["tau"].item() == pytest.approx(0.3, rel=1e-5)
    exp.set_step(5)
    assert exp.schedule_values()["tau"].item() == pytest.approx(2.0 * (0.3 / 2.0) ** 0.5, rel=1e-5)
    assert build(schedule_steps=100).config.tau_horizon == 100
