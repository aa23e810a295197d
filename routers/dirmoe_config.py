"""DirMoE's options (:class:`DirMoEConfig`): the paper's routing table, and the gaps and inconsistencies of the
paper closed with documented, switchable defaults (the numbered list below, with the evidence for each).

The measurements behind the numbered defaults are in docs/routers.md, "DirMoE's gaps: what was measured".

Gaps and inconsistencies in the paper, and the switchable defaults chosen here
---------------------------------------------------------------------------------

1. **Gate bias vs. centering, and what the bias init sets** (``center_logits``, ``gate_bias_init``). The
   paper centres the logits per token (``l <- l - mean_i l``) *and* initialises the gate bias to
   ``tau_0 logit(k/E)``; a bias equal across experts cancels under centering, so the init would be a no-op.
   Resolution: centre only the x-dependent part ``W x`` and add the (per-expert, learnable) bias afterwards,
   so the common level of the logits stays learnable (it is what the sparsity penalty moves).

   The paper's init sets the *noise-free* relaxed gate, ``sigmoid(b / tau_0) = k/E`` (the median of z~ at
   step 0), not how often an expert is selected: ``z~_i >= c`` exactly when ``l_i + g_i >= tau logit(c)``,
   so ``P(z~_i >= c) = sigmoid(l_i - tau logit(c))``. At the default threshold c = 1/2 that is
   ``sigmoid(tau_0 logit(k/E))`` = 0.020 for E = 8, k = 1, tau_0 = 2 (not k/E = 0.125), and a token has no
   expert above the threshold with probability ``(1 - 0.020)^8 = 0.85``: at step 0 about 85% of the tokens
   are dispatched by the threshold rule's arg-max fallback alone (gap 2; metric ``fallback_share``). Options:

   * ``"tempered"`` (default, the paper's table): ``b = tau_0 logit(k/E)``.
   * ``"inclusion"``: ``b = logit(k/E) + tau_0 logit(z_threshold)``: at step 0 (the x-dependent part aside)
     every expert passes the threshold with probability exactly k/E, so k selected experts per token in
     expectation and a fallback share of ``(1 - k/E)^E`` (0.34 for E = 8, k = 1). At z_threshold = 1/2 it is
     ``logit(k/E)``, the hard spike's prior inclusion rate pi = k/E.

   Evidence: docs/routers.md, "DirMoE's gaps: what was measured".

2. **Dispatch rule** (``dispatch``, ``dense_steps``, ``z_threshold``, ``max_experts_per_token``,
   ``renormalize``). The paper mixes all E experts (``y = sum_i r_i E_i(x)``) but trains with dropless
   kernels at about the compute of k = 1, and never says which experts actually run. Options:

   * ``"threshold"`` (default): the experts with ``z~_i >= z_threshold``; always at least the one with the
     largest ``r`` (the *fallback*: no token is left to the residual alone); at most
     ``max_experts_per_token`` (default ``min(E, 2k)``), keeping the largest ``r``. Declared as
     ``VARIABLE [1, cap]``. The share of tokens dispatched by the fallback alone (no gate above the
     threshold) is the metric ``fallback_share`` (gap 1 for its value at step 0).
   * ``"topk"``: the k largest ``r`` (exact compute parity with Switch). Declared as ``EXACT_K``.
   * ``"dense"``: every expert, ``probs = r``: the paper's literal Eq. (moe_soft), E times the expert compute
     of k = 1, for small models and ablations. Declared as ``EXACT_K`` with E experts per token and probs
     summing to one (r does).

   ``dense_steps`` (default 0) dispatches densely while ``step < dense_steps`` and by ``dispatch`` from then
   on (every expert receives every token's gradient while the router is still exploring); the declared
   constraint then spans both phases, ``VARIABLE [min of the rule, E]``, and the metric ``dense_phase`` is 1
   during the dense steps.

   Why ``"threshold"`` with ``z_threshold = 0.5``: ``z~_i >= 1/2`` holds exactly when ``l_i + g_i >= 0``, an
   exact sample of the hard spike ``z_i ~ Bernoulli(sigmoid(l_i))`` at any temperature, so the dispatched set
   is the paper's own active set ``S(x) = {i : z_i = 1}`` and the number of experts per token is what the
   sparsity penalty controls (the paper's variable-k claims, its "average and maximum number of active
   experts" figure and its lambda_sparsity ablation only make sense if the count can vary). Compute parity
   with Switch then holds in expectation once ``E[sum z~] ~ k`` (the "measured" TFLOP/s uses the measured
   count); the cap bounds the worst case. ``"topk"`` is one flag away for exact parity, the paper's
   "z-threshold 0.125" (a metrics threshold) one value away. ``probs = r`` on the dispatched experts and zero
   elsewhere; ``renormalize`` (default off) rescales them to sum to one. Off because with k = 1 a
   renormalised weight is identically 1, so the LM loss would send the router no gradient at all. The
   routing-weight mass the rule drops, ``mean_t (1 - sum_{i dispatched} r_ti)``, is the metric
   ``dropped_mass``.

   Evidence: docs/routers.md, "DirMoE's gaps: what was measured".

3. **Reconstruction target detached** (``detach_recon_target``, default True). The paper's ``p(x | r)``
   treats x as data, as in an ordinary VAE. Here x is a learned representation: with the target attached,
   the cheapest way to lower the reconstruction term is for the backbone to shrink or flatten x (e.g. the
   pre-MLP RMSNorm scale towards 0), a degenerate solution that fights the LM loss. Detaching the target
   keeps x as data; the router's heads still read x, so the aux losses reach the backbone through the
   encoder path as any router's aux loss does. (Which target is reconstructed: gap 9.)

4. **Hyperparameter table** (``hparam_reading``). The routing table says m = 0.9 but r = 39.7 "for
   m = 0.85"; and ``alpha_lo^(0) = 0.005`` with ``alpha_hi^(0) = r alpha_lo^(0) ~ 1.99``, which only fits
   ``alpha_lo^(0) = 0.05``. Readings (:data:`HPARAM_READINGS`; ``prior_mass``, ``alpha_lo_init`` and
   ``alpha_floor`` override single values):

   * ``"ratio"`` (default): m = 0.85, alpha_lo^(0) = 0.05, alpha_floor = 0.005. Reproduces both derived
     numbers of the table (r = 39.67, alpha_hi^(0) = 1.98 for E = 8, k = 1), with 0.005 read as the floor
     that the "alpha_lo^(0) / floor" row names.
   * ``"literal"``: m = 0.9, alpha_lo^(0) = alpha_floor = 0.005 (alpha_lo constant, r = 63, alpha_hi = 0.315
     for E = 8, k = 1).

5. **Reconstruction reduction** (``recon_reduction``, default ``"mean"``). The paper sums the squared error
   over the D dimensions with sigma^2 = 1. For RMS-normalised x, ``||x||^2 ~ D``, so at D = 768 that term is
   ~384 per token per layer at init (~4600 over 12 layers) against an LM loss ~10: it dominates the total
   loss and, under the global grad clip of 1.0, shrinks the LM's updates. ``"mean"`` (per-dimension) is the
   paper's Gaussian decoder with sigma^2 = D, still within the paper's model, and keeps the term O(1).
   ``"sum"`` restores the paper's literal scale (evidence: docs/routers.md, "DirMoE's gaps: what was
   measured").

6. **Schedule horizons** (``schedule_steps``, default 10 000; ``tau_schedule_steps``). The paper gives end
   points (tau 2.0 -> 0.3 "short", lambda_p 0.5 -> 0.3 "slow exp/cosine") but no horizon or decay rates.
   Cosine schedules reach their end value at their horizon and stay there. Exponential ones (the paper's
   ``max(tau_min, tau_0 rho^t)``, ``lambda_p^(0) eta^t``, ``max(alpha_floor, alpha_lo^(0) gamma^t)``) take
   their decay factor from the config or, when it is None, the one that reaches the end value at the
   horizon; lambda_p's exponential is floored at ``lambda_p_end`` (the table's end point). 10 000 is the
   paper's ablation-run length (1/6 of its 60k main run); experiment configs should set it. The temperature
   has a horizon of its own, ``tau_schedule_steps`` (None, the default: ``schedule_steps``). The paper calls
   the temperature schedule "short" (Sec. "Temperature schedule") without a length; the **"short" preset**
   is ``tau_schedule_steps = schedule_steps // 10`` (tau at its end value after the first tenth of the run;
   the tenth is a choice, the paper gives no number), the "full" one ``tau_schedule_steps = None``.
   Evidence: docs/routers.md, "DirMoE's gaps: what was measured". Every schedule value is a pure function of
   the ``step`` buffer, so a checkpoint
   restores it exactly.

7. **Small posterior concentrations** (``posterior_alpha_min``, default 1e-3): added to the softplus bases
   so ``alpha_q >= lambda_q * 1e-3``; Dirichlet sampling gradients blow up as concentrations go to 0.
   (Not in the paper; its "epsilon clamp: off" refers to the router output, which is kept unclamped.)

8. **Decoder** (``decoder_hidden_size``): g_psi is a single ``Linear(E, D)`` with bias by default (the
   paper only says "a single network from the simplex to R^d"); a positive value gives a one-hidden-layer
   SiLU MLP. Posterior heads start at the prior's bases (``softplus(bias) + alpha_min = alpha_hi^(0)`` /
   ``alpha_lo^(0)``).

9. **Reconstruction target: raw or centred** (``recon_target``, ``recon_mean_momentum``, ``recon_weight``).
   The paper reconstructs x itself. The reading behind the options: reconstructing a
   router input dominated by a component all tokens share pulls every token's r towards the decoder column
   that best fits that mean, which is also what picks the expert (a codebook collapse; metrics
   ``input_mean_energy`` and ``decoder_mean_alignment``); centring the target removes the shared part.
   Evidence: docs/routers.md, "DirMoE's gaps: what was measured". Options:

   * ``"raw"`` (default, the paper): ``||x_t - g_psi(r_t)||^2``.
   * ``"centered"``: the micro-batch mean removed from the target, ``||(x_t - mean_s x_s) - g_psi(r_t)||^2``
     (not from the prediction: that would leave the decoder's bias without a gradient). With the target
     attached (gap 3) the mean is attached too.
   * ``"data_mean"``: ``||x_t - (mu + g_psi(r_t))||^2``, ``mu`` a buffer holding the data mean: the first
     training micro-batch's mean, then an exponential moving average of the micro-batch means with
     ``recon_mean_momentum`` (default 0.01; updated before use, in training forwards only). Momentum 0 is
     the decoder's bias initialised at the (first batch's) data mean and learned from there (``mu + b``, b
     starting at 0); momentum 1 is ``"centered"`` in training. A buffer rather than a parameter set from the
     data: data-parallel replicas see different first batches, and such a parameter would differ between
     replicas for the whole run; a statistic like BatchNorm's running mean is rank-local by nature (replicas
     agree within about 1/momentum steps; a checkpoint keeps its writer's value).

   ``recon_weight`` (default 1) multiplies the term; 0 switches it off (gap 11). ``recon_sigma2`` keeps its
   meaning (the paper's sigma^2); the two only differ in that 0 is a valid weight.

10. **Posterior scale against the KL** (``posterior_scale``). The paper fixes lambda_q by the calibrator
    "to hit a target h" (Sec. "Which lambda to tune?") and lets ``alpha_hi(x)``, ``alpha_lo(x)`` be free
    learned functions (Eq. alpha-q). But only the products ``lambda_q alpha_hi(x)``, ``lambda_q alpha_lo(x)``
    enter the posterior, and ``KL(Dir(alpha_q) || Dir(alpha_p))`` is minimised at ``alpha_q = alpha_p``: the
    heads can and do shrink by lambda_p / lambda_q, undoing the calibration (the Lemma's E[H] depends on the
    bases' total through ``lambda B``; evidence: docs/routers.md, "DirMoE's gaps: what was measured"). The
    remedy that follows from the equations: make the KL's
    optimum the calibrated posterior, i.e. one scale for both. Options:

    * ``"free"`` (default, the paper).
    * ``"tied"``: ``lambda_q := lambda_p^(t)``, the posterior at the prior's scale, which is the knob (the
      target Simpson index is computed with it). The concentrations are those the KL drives ``"free"`` to
      anyway (``>= lambda_p^(t) * posterior_alpha_min`` ~ 3e-4 at the bound: draws that small lose
      precision in the Gamma sampler).
    * ``"prior_matched"``: the prior at the posterior's scale, ``alpha_p = lambda_q (lambda_p^(t) /
      lambda_p^(0)) (...)``, lambda_p's schedule kept as a relative decay ("mildly decay lambda_p"). lambda_q
      stays the calibrated knob, and at step 0 the posterior already sits at the KL's optimum.
    * ``"normalized"``: ``alpha_q = lambda_q beta(x) B_p(z~) / sum_i beta_i(x)`` with ``beta = z~ alpha_hi(x)
      + (1 - z~) alpha_lo(x)`` and ``B_p(z~) = sum_i (z~_i alpha_hi^(t) + (1 - z~_i) alpha_lo^(t))``: the
      heads set only the posterior's shape and cannot absorb the scale; its total is lambda_q times the
      prior's base total at the same gates, what the calibrator assumes. At step 0 it equals ``"free"``. It
      does not keep the calibrated Simpson index: with the total pinned, the KL sharpens the shape instead
      (prior concentrations below 1 reward near-vertex theta), and by the Lemma E[H] -> S2/B^2 for a peaked
      shape at a large total.

    ``tests/test_dirmoe.py::test_what_the_kl_does_to_the_posterior_under_each_scale_option`` trains the
    heads on the KL alone (one batch of 128 random tokens, Adam lr 0.05, 120 steps) and checks these
    behaviours: ``"free"`` goes from posterior/prior total 40 to below 2 with the expected Simpson index of
    theta above the target at its gates; ``"normalized"`` stays at 40 with the Simpson index 0.2 or more
    above it; ``"tied"`` and ``"prior_matched"`` stay at ratio 1 and on their target.

11. **Loss terms switchable** (``recon_weight``, ``kl_weight``, ``sparsity_weight``). A weight of 0 leaves
    that aux loss out (no backward through it); its unweighted value stays in the metrics (``recon``,
    ``kl``, ``sparsity``).

12. **Switch's load-balancing loss as a control** (``balance_loss_coeff``, default 0: the paper uses no
    balancing loss). When positive, the aux loss ``load_balancing_loss`` is megatron-core's
    ``switch_load_balancing_loss_func`` (as :mod:`baselines.switch` calls it) over DirMoE's routing weights
    r (all E, the analogue of Switch's full softmax) and its dispatch map (tokens per expert), with
    ``topk = k``: ``coeff * E * sum_i f_i P_i``, ``f_i = tokens_i / (k T)``. With a variable count the f_i
    sum to the mean experts per token over k. Like Switch, only in training forwards with grad enabled; the
    metric ``balance_loss`` (coefficient 1) is reported always.

Implementation option (not the maths)
--------------------------------------

``compile_elementwise`` (default ``"auto"``). Everything the training computes (heads, Logistic noise, relaxed
gates, concentrations, the Dirichlet draw, the dispatch, combine weights, g_psi and the three loss terms:
:meth:`~routers.dirmoe.DirMoERouter.route_core`) runs eagerly (the reference; in training with a closed-form
backward, :func:`routers.dirmoe_blocks.routing_sample`) or as one ``torch.compile`` region, forward and backward
one compiled graph each. Inside the region the gates' uniforms come from inductor's generator (other numbers than
eager's, the same distribution) and the Dirichlet draw is ATen's kernel called from the region; with the uniforms
passed in (``sample(u_TE=...)``) and the same seed both modes agree up to float32 rounding (routing maps equal,
everything else within 1e-3 of each tensor's scale: ``tests/test_dirmoe_compile.py``). ``"auto"`` compiles on
CUDA where inductor has all it needs (Triton, and the host C compiler Triton builds its launchers with: ``$CC``,
gcc or clang) and otherwise runs eager with one warning; on CPU it runs eager; ``"always"`` compiles wherever
inductor can (a C++ compiler on CPU) and otherwise fails naming what is missing; ``"never"`` is eager everywhere.
What one call costs in launches and host syncs, compiled and eager, against the other routers: ``python -m repro
efficiency --profile`` (``results/bench/router_costs.md``). Eager on CPU because compiling did not pay there:
at the tiny model's shape a training iteration gained nothing, while compiling costs minutes per process (the
runs: ``results/bench/README.md``; their commands: docs/efficiency.md, "Router micro-benchmarks"). On a GPU,
where the eager maths is a string of small kernels, the fusion is expected to pay; ``python -m repro
efficiency`` measures it there (docs/efficiency.md, "Efficiency on any number of GPUs").

Metrics (all detached; ``[E]`` marks per-expert vectors)
--------------------------------------------------------

The shared ones (:func:`routers.metrics.routing_metrics`: ``active_experts``, ``max_active_experts``,
``unrouted_tokens``, ``simpson``, ``tokens_per_expert`` [E], ``load_imbalance``), and: ``load_share`` [E]
(tokens per expert / all dispatches) and ``weight_share`` [E] (mean r per expert, Switch's P_i);
``fallback_share`` (gap 2); ``dense_phase``; ``dropped_mass``; ``expected_active`` (mean sum of z~); ``recon``,
``kl``, ``sparsity`` (unweighted); ``balance_loss`` (gap 12); ``input_mean_energy`` ``= ||mean_t x_t||^2 /
mean_t ||x_t||^2``, the share of the input's second moment in the component shared by all tokens (``mean_t
||x_t||^2 = ||mean x||^2 + mean_t ||x_t - mean x||^2``, so it is in [0, 1]); ``decoder_mean_alignment``, the mean
over experts of ``cos(g_psi(e_i) - g_psi(0), mean_t x_t)`` (for the linear decoder the i-th column of its weight;
``mu`` of ``"data_mean"`` is not part of it); ``simpson_r``, ``simpson_theta`` (of the draws);
``simpson_theta_expected`` (the Lemma per token under the actual posterior, averaged); ``simpson_theta_target``
(the calibrator's target: the Lemma with the posterior scale in use, ``lambda_q``, or lambda_p^(t) when
``"tied"``, and the prior's current bases on an ideal active set, ``alpha_hi^(t)`` on k experts and
``alpha_lo^(t)`` on E - k); ``simpson_theta_target_gates`` (the same scale and bases mixed by the actual relaxed
gates, per token, averaged: what the posterior's Simpson index would be had the heads kept the prior's bases);
``lambda_q`` (the scale in use), ``posterior_total`` and ``prior_total`` (mean total concentrations of alpha_q
and alpha_p); and the schedule values ``tau``, ``lambda_p``, ``alpha_lo``, ``alpha_hi``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

from routers.base import RouterConfig, require
from routers.dirichlet import RECON_REDUCTIONS, alpha_ratio, is_finite_number

__all__ = ["DirMoEConfig", "HPARAM_READINGS", "PriorConstants"]


#: The two readings of the paper's routing-hyperparameter table: (m, alpha_lo^(0), alpha_floor).
HPARAM_READINGS = types.MappingProxyType(
    {
        "ratio": (0.85, 0.05, 0.005),  # reproduces the table's r = 39.67 and alpha_hi^(0) = 1.98 (E=8, k=1)
        "literal": (0.9, 0.005, 0.005),  # the table's m row and alpha_lo^(0) row as printed
    }
)
_SCHEDULES = ("cosine", "exponential")
_DISPATCH = ("threshold", "topk", "dense")
_RECON_TARGETS = ("raw", "centered", "data_mean")
_GATE_BIAS_INITS = ("tempered", "inclusion")
_POSTERIOR_SCALES = ("free", "tied", "prior_matched", "normalized")
_COMPILE_MODES = ("auto", "always", "never")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    return is_finite_number(value) and value > 0


@dataclass(frozen=True)
class PriorConstants:
    """The prior's constants resolved from a :class:`DirMoEConfig` (see :meth:`DirMoEConfig.prior_constants`)."""

    mass: float  # m, the prior mean mass on the k active experts
    ratio: float  # r = alpha_hi / alpha_lo = m/(1-m) (E-k)/k
    alpha_lo_init: float  # alpha_lo^(0)
    alpha_hi_init: float  # alpha_hi^(0) = r alpha_lo^(0)
    alpha_floor: float  # the floor of alpha_lo^(t)


@dataclass(frozen=True)
class DirMoEConfig(RouterConfig):
    """DirMoE's options (defaults: the paper's routing table, gaps closed as the module docstring says).

    Every field is an option of ``build_router("dirmoe", ...)``.
    """

    # ---- gates (spike)
    center_logits: bool = True  # per-token centering of the x-dependent logits; bias added after (gap 1)
    gate_bias_init: str = "tempered"  # "tempered" (paper: b = tau_0 logit(k/E)) | "inclusion" (gap 1)
    tau_start: float = 2.0  # tau_z at step 0 (paper: 2.0)
    tau_end: float = 0.3  # tau_z from the tau horizon on (paper: 0.3)
    tau_schedule: str = "cosine"  # "cosine" (paper table) | "exponential" (paper Eq.: max(tau_min, tau_0 rho^t))
    tau_decay: float | None = None  # rho for "exponential"; None: reach tau_end at tau_schedule_steps
    # horizon of tau alone; None: schedule_steps ("full"); the "short" preset is schedule_steps // 10 (gap 6)
    tau_schedule_steps: int | None = None
    # ---- slab (Dirichlet)
    lambda_q: float = 20.0  # posterior scale lambda^(q) (paper: 20)
    posterior_scale: str = "free"  # "free" (paper) | "tied" | "prior_matched" | "normalized" (gap 10)
    hparam_reading: str = "ratio"  # "ratio" | "literal": which reading of the paper's table (gap 4)
    prior_mass: float | None = None  # m; None: from hparam_reading (0.85 ratio / 0.9 literal)
    alpha_lo_init: float | None = None  # alpha_lo^(0); None: from hparam_reading (0.05 / 0.005)
    alpha_floor: float | None = None  # floor of alpha_lo^(t); None: from hparam_reading (0.005 / 0.005)
    # gamma in alpha_lo^(t) = max(floor, alpha_lo^(0) gamma^t); None: reach the floor at schedule_steps
    alpha_decay: float | None = None
    lambda_p_start: float = 0.5  # prior scale lambda^(p) at step 0 (paper: 0.5)
    lambda_p_end: float = 0.3  # prior scale from schedule_steps on (paper: 0.3)
    lambda_p_schedule: str = "cosine"  # "cosine" | "exponential" (paper: "slow exp/cosine")
    lambda_p_decay: float | None = None  # eta for "exponential"; None: reach lambda_p_end at schedule_steps
    schedule_steps: int = 10_000  # horizon of all schedules (paper gives none; gap 6)
    posterior_alpha_min: float = 1e-3  # added to the softplus bases: keeps Dirichlet gradients finite (gap 7)
    # ---- router output and dispatch (gap 2)
    weight_leak: float = 1e-3  # eps_w in r = normalize(z~ * theta + eps_w) (paper: 1e-3)
    dispatch: str = "threshold"  # "threshold" (z~ >= z_threshold, in [1, cap]) | "topk" (k largest r) | "dense"
    dense_steps: int = 0  # dispatch to every expert while step < dense_steps, then by `dispatch` (gap 2)
    z_threshold: float = 0.5  # 0.5 = an exact sample of the hard Bernoulli spike; paper's metrics use 0.125
    max_experts_per_token: int | None = None  # cap of "threshold"; None: min(E, 2k). Unused by the others
    renormalize: bool = False  # rescale the dispatched r to sum to one (off: keeps the LM gradient at k=1)
    # ---- losses
    kl_weight: float = 1e-2  # beta_theta (paper: 1e-2)
    sparsity_weight: float = 1e-2  # lambda_sparsity (paper: 1e-2)
    recon_sigma2: float = 1.0  # sigma^2 of the Gaussian decoder (paper: 1.0)
    recon_weight: float = 1.0  # multiplies the reconstruction term; 0 switches it off (gap 11)
    recon_target: str = "raw"  # "raw" (paper) | "centered" (batch mean removed) | "data_mean" (gap 9)
    recon_mean_momentum: float = 0.01  # EMA momentum of the "data_mean" buffer (0: the first batch's mean)
    recon_reduction: str = "mean"  # "mean" over D (= sum with sigma^2 * D) | "sum" (paper) (gap 5)
    detach_recon_target: bool = True  # treat x as data in the reconstruction term (gap 3)
    decoder_hidden_size: int = 0  # 0: g_psi = Linear(E, D); > 0: Linear(E, H) -> SiLU -> Linear(H, D)
    init_std: float = 0.01  # std of the heads' and decoder's weights (the model's init std)
    balance_loss_coeff: float = 0.0  # Switch's load-balancing loss on r and the dispatch map; 0: off (gap 12)
    # ---- implementation (not the maths)
    compile_elementwise: str = "auto"  # "auto" | "always" | "never": one torch.compile region (see above)

    def __post_init__(self) -> None:
        super().__post_init__()
        E, k = self.num_experts, self.top_k
        if k >= E:
            raise ValueError(f"top_k must be < num_experts={E} for dirmoe (the prior needs inactive experts), got {k}")

        def check(names: str, ok: Callable[[object], bool], rule: str) -> None:
            for name in names.split():
                require(ok(getattr(self, name)), name, getattr(self, name), rule)

        check("center_logits renormalize detach_recon_target", lambda v: isinstance(v, bool), "True or False")
        check("tau_start tau_end lambda_q lambda_p_start lambda_p_end recon_sigma2 init_std posterior_alpha_min "
              "weight_leak", _positive, "a positive finite number")
        check("kl_weight sparsity_weight recon_weight balance_loss_coeff", lambda v: is_finite_number(v) and v >= 0,
              "a finite number >= 0")
        require(self.tau_end <= self.tau_start, "tau_end", self.tau_end, f"in (0, tau_start={self.tau_start}]")
        require(self.lambda_p_end <= self.lambda_p_start, "lambda_p_end", self.lambda_p_end,
                f"in (0, lambda_p_start={self.lambda_p_start}]")
        for name, options in (
            ("tau_schedule", _SCHEDULES), ("lambda_p_schedule", _SCHEDULES), ("hparam_reading", tuple(HPARAM_READINGS)),
            ("dispatch", _DISPATCH), ("recon_reduction", RECON_REDUCTIONS), ("recon_target", _RECON_TARGETS),
            ("gate_bias_init", _GATE_BIAS_INITS), ("posterior_scale", _POSTERIOR_SCALES),
            ("compile_elementwise", _COMPILE_MODES),
        ):
            value = getattr(self, name)
            require(value in options, name, value, f"one of {', '.join(map(repr, options))}")
        check("recon_mean_momentum", lambda v: is_finite_number(v) and 0 <= v <= 1, "in [0, 1]")
        check("dense_steps decoder_hidden_size", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
        check("tau_schedule_steps", lambda v: v is None or (_is_int(v) and v >= 1), "None or an integer >= 1")
        check("tau_decay alpha_decay lambda_p_decay", lambda v: v is None or (is_finite_number(v) and 0 < v <= 1),
              "None or in (0, 1]")
        check("schedule_steps", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        check("prior_mass", lambda v: v is None or (is_finite_number(v) and 0 < v < 1), "None or in (0, 1)")
        check("alpha_lo_init alpha_floor", lambda v: v is None or _positive(v), "None or a positive finite number")
        prior = self.prior_constants()
        if not prior.mass > k / E:
            # The paper's slab needs alpha_hi > alpha_lo, i.e. r > 1, i.e. m > k/E.
            raise ValueError(
                f"prior_mass (m, from hparam_reading={self.hparam_reading!r} unless set) must be in "
                f"(k/E = {k / E:g}, 1) so that alpha_hi > alpha_lo, got {prior.mass}"
            )
        require(prior.alpha_floor <= prior.alpha_lo_init, "alpha_floor", prior.alpha_floor,
                f"in (0, alpha_lo_init={prior.alpha_lo_init}]")
        require(self.posterior_alpha_min < prior.alpha_lo_init, "posterior_alpha_min", self.posterior_alpha_min,
                f"in (0, alpha_lo_init={prior.alpha_lo_init})")
        check("z_threshold", lambda v: is_finite_number(v) and 0 < v < 1, "in (0, 1)")
        check("max_experts_per_token", lambda v: v is None or (_is_int(v) and 1 <= v <= E),
              f"None or an integer in [1, num_experts={E}]")

    @property
    def tau_horizon(self) -> int:
        """Steps over which tau anneals: ``tau_schedule_steps``, or ``schedule_steps`` when it is None."""
        return self.schedule_steps if self.tau_schedule_steps is None else self.tau_schedule_steps

    def prior_constants(self) -> PriorConstants:
        """Returns:
            m, r, alpha_lo^(0), alpha_hi^(0) and the floor from the reading and the overrides, as a
            :class:`PriorConstants`."""
        m0, lo0, floor0 = HPARAM_READINGS[self.hparam_reading]
        m = m0 if self.prior_mass is None else self.prior_mass
        lo = lo0 if self.alpha_lo_init is None else self.alpha_lo_init
        floor = floor0 if self.alpha_floor is None else self.alpha_floor
        r = alpha_ratio(m, self.num_experts, self.top_k)
        return PriorConstants(mass=m, ratio=r, alpha_lo_init=lo, alpha_hi_init=r * lo, alpha_floor=floor)

    def dispatch_cap(self) -> int:
        """Most experts the rule ``dispatch`` sends a token to: k for ``"topk"``, E for ``"dense"``, else the
        (resolved) cap of ``"threshold"`` (the dense steps of ``dense_steps`` aside)."""
        if self.dispatch == "threshold":
            cap = self.max_experts_per_token
            return min(self.num_experts, 2 * self.top_k) if cap is None else cap
        return self.top_k if self.dispatch == "topk" else self.num_experts
