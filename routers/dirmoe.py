"""DirMoE: the Dirichlet-routed Mixture-of-Experts router (Vahidi et al., "DirMoE: Dirichlet-Routed Mixture
of Experts", ICLR 2026 submission). No public code exists; this module is written from the paper.

Method (paper Sec. 4 and Appendix "Objective function"), per token x (the MoE layer's input):

* Heads on x: gate logits ``l(x)`` in R^E and positive posterior bases ``alpha_hi(x)``, ``alpha_lo(x)`` in
  R^E (softplus of linear heads).
* Relaxed spike (binary concrete / Gumbel-sigmoid): ``z~ = sigmoid((l + g) / tau_z)``, ``g ~ Logistic(0,1)``.
* Slab posterior ``Dir(alpha_q)``, ``alpha_q = lambda_q (z~ alpha_hi(x) + (1 - z~) alpha_lo(x))``, sampled
  with ``torch.distributions.Dirichlet(...).rsample()`` (normalised Gamma, implicit reparameterisation).
* Slab prior ``Dir(alpha_p)``, ``alpha_p = lambda_p^(t) (sg(z~) alpha_hi^(t) + (1 - sg(z~)) alpha_lo^(t))``
  with scheduled constants ``alpha_hi^(t) = r alpha_lo^(t)``, ``r = m/(1-m) (E-k)/k`` (:func:`alpha_ratio`).
* Routing weights ``r = normalize(z~ * theta + eps_w)``.
* Loss (mean over tokens): ``||x - g_psi(r)||^2 / (2 sigma^2) + beta_theta KL(Dir(alpha_q) || Dir(alpha_p))
  + lambda_sparsity (sum_i z~_i - k)^2``, returned as the aux losses ``dirmoe_recon``, ``dirmoe_kl`` and
  ``dirmoe_sparsity`` (each already weighted).
* Evaluation (``router.eval()``) is deterministic: no logistic noise, ``theta`` = the posterior mean.
* All router maths (logits, gates, Dirichlet, KL, decoder) runs in float32 whatever the model dtype.

The paper's calibration maths is public here: :func:`expected_simpson` (Lemma), :func:`lambda_for_simpson`
(symmetric calibrator), :func:`lambda_for_mass_variance` (two-group Beta calibrator), :func:`alpha_ratio`,
:func:`dirichlet_kl` (closed-form KL) and :func:`dirichlet_expected_simpson` (the Lemma per token), and so
is the reconstruction term, :func:`reconstruction_loss`.

Evidence cited below as "measured" comes from 600-step runs of the ``tiny`` flavour on the embedded
mini-pile, ``python -m repro train --experiment dirmoe-tiny --set steps=600 --set router_options.NAME=VALUE``
(single seed unless noted). "Imbalance a/b" is the load imbalance (max / mean tokens per expert) of layer 1 /
layer 2 at the end of the run; Switch's is 2.7 in the same comparison, the default DirMoE's 6.5 (layer 2
sends ~100% of its tokens to one expert).

Gaps and inconsistencies in the paper, and the switchable defaults chosen here
---------------------------------------------------------------------------------

1. **Gate bias vs. centering, and what the bias init sets** (``center_logits``, ``gate_bias_init``). The
   paper centres the logits per token (``l <- l - mean_i l``) *and* initialises the gate bias to
   ``tau_0 logit(k/E)``; a bias that is equal across experts cancels under centering, so the init would be
   a no-op. Resolution: centre only the x-dependent part ``W x`` and add the (per-expert, learnable) bias
   afterwards, so the common level of the logits stays learnable (it is what the sparsity penalty moves).

   What the paper's init sets is the *noise-free* relaxed gate: ``sigmoid(b / tau_0) = k/E``, the median of
   z~ at step 0. It does not set how often an expert is selected: ``z~_i >= c`` exactly when
   ``l_i + g_i >= tau logit(c)``, so ``P(z~_i >= c) = sigmoid(l_i - tau logit(c))``. At the default
   threshold c = 1/2 that is ``sigmoid(b) = sigmoid(tau_0 logit(k/E))`` = 0.020 for E = 8, k = 1,
   tau_0 = 2 (not k/E = 0.125), and a token has no expert above the threshold with probability
   ``(1 - 0.020)^8 = 0.85``: at step 0 about 85% of the tokens are dispatched by the threshold rule's arg-max
   fallback alone (gap 2; metric ``fallback_share``). Options:

   * ``"tempered"`` (default, the paper's table): ``b = tau_0 logit(k/E)``.
   * ``"inclusion"``: ``b = logit(k/E) + tau_0 logit(z_threshold)``, so that at step 0 (the x-dependent part
     aside) every expert passes the dispatch threshold with probability exactly k/E: k selected experts per
     token in expectation, and a fallback share of ``(1 - k/E)^E`` (0.34 for E = 8, k = 1). At
     z_threshold = 1/2 it is ``logit(k/E)``, the hard spike's prior inclusion rate pi = k/E.

   Measured: the gate-bias init is not what makes the default collapse (gap 9).

2. **Dispatch rule** (``dispatch``, ``dense_steps``, ``z_threshold``, ``max_experts_per_token``,
   ``renormalize``). The paper mixes all E experts (``y = sum_i r_i E_i(x)``) but trains with dropless
   kernels at about the compute of k = 1, and never says which experts actually run. Options:

   * ``"threshold"`` (default): the experts with ``z~_i >= z_threshold``; always at least the expert with
     the largest ``r`` (the *fallback*: no token is left to the residual alone); at most
     ``max_experts_per_token`` (default ``min(E, 2k)``), keeping the ones with the largest ``r``. Declared
     as ``VARIABLE [1, cap]``. The share of tokens whose dispatched set is the fallback alone (no gate above
     the threshold) is the metric ``fallback_share`` (gap 1 for its value at step 0).
   * ``"topk"``: the k largest ``r`` (exact compute parity with Switch). Declared as ``EXACT_K``.
   * ``"dense"``: every expert, ``probs = r``: the paper's literal Eq. (moe_soft). E times the expert compute
     of k = 1, for small models and ablations. Declared as ``EXACT_K`` with E experts per token and probs
     summing to one (r does).

   ``dense_steps`` (default 0) dispatches densely while ``step < dense_steps`` and by ``dispatch`` from
   then on (every expert receives every token's gradient while the router is still exploring); the
   declared constraint then spans both phases, ``VARIABLE [min of the rule, E]``, and the metric
   ``dense_phase`` is 1 during the dense steps.

   Default ``"threshold"`` with ``z_threshold = 0.5``: ``z~_i >= 1/2`` holds exactly when
   ``l_i + g_i >= 0``, i.e. it is an exact sample of the hard spike ``z_i ~ Bernoulli(sigmoid(l_i))`` at
   any temperature, so the dispatched set is the paper's own active set ``S(x) = {i : z_i = 1}`` and the
   number of experts per token is what the sparsity penalty controls (the paper's variable-k claims, its
   "average and maximum number of active experts" figure and its lambda_sparsity ablation only make sense
   if the count can vary). Compute parity with Switch then holds in expectation once ``E[sum z~] ~ k``
   (the "measured" TFLOP/s uses the measured count); the cap bounds the worst case. ``"topk"`` is one
   flag away for exact parity. The paper's "z-threshold 0.125" (a metrics threshold) is one value away.
   ``probs = r`` on the dispatched experts and zero elsewhere; ``renormalize`` (default off) rescales
   them to sum to one. Off because with k = 1 a renormalised weight is identically 1, so the LM loss would
   send no gradient to the router at all. The routing-weight mass the rule drops,
   ``mean_t (1 - sum_{i dispatched} r_ti)``, is reported as the metric ``dropped_mass``.

   Measured: the dispatch rule does not cause the collapse: ``dispatch=topk`` imbalance 5.3/6.3,
   ``z_threshold=0.125`` 4.4/6.3 (~1.5 experts per token), all experts mixed densely
   (``y = sum_i r_i E_i(x)``) collapses onto the same expert, ``renormalize=True`` 6.2/7.4.

3. **Reconstruction target detached** (``detach_recon_target``, default True). The paper's ``p(x | r)``
   treats x as data, as in an ordinary VAE. Here x is a learned representation: with the target attached,
   the cheapest way to lower the reconstruction term is for the backbone to shrink or flatten x (e.g. the
   pre-MLP RMSNorm scale towards 0), a degenerate solution that fights the LM loss. Detaching the target
   keeps x as data; the router's heads still read x, so the aux losses reach the backbone through the
   encoder path as any router's aux loss does. (Which target is reconstructed: gap 9.)

4. **Hyperparameter table** (``hparam_reading``). The routing table says m = 0.9 but r = 39.7 "for
   m = 0.85"; and ``alpha_lo^(0) = 0.005`` with ``alpha_hi^(0) = r alpha_lo^(0) ~ 1.99``, which only fits
   ``alpha_lo^(0) = 0.05``. Readings:

   * ``"ratio"`` (default): m = 0.85, alpha_lo^(0) = 0.05, alpha_floor = 0.005. Reproduces both derived
     numbers of the table (r = 39.67, alpha_hi^(0) = 1.98 for E = 8, k = 1), with 0.005 read as the floor
     that the "alpha_lo^(0) / floor" row names.
   * ``"literal"``: m = 0.9, alpha_lo^(0) = alpha_floor = 0.005 (so alpha_lo is constant, r = 63,
     alpha_hi = 0.315 for E = 8, k = 1).

   ``prior_mass``, ``alpha_lo_init`` and ``alpha_floor`` override single values of the chosen reading.

5. **Reconstruction reduction** (``recon_reduction``, default ``"mean"``). The paper sums the squared error
   over the D dimensions with sigma^2 = 1. For RMS-normalised x, ``||x||^2 ~ D``, so at D = 768 that term is
   ~384 per token per layer at init (~4600 over 12 layers) against an LM loss ~10: it dominates the total
   loss and, under the global grad clip of 1.0, shrinks the LM's updates. ``"mean"`` (per-dimension) is the
   paper's Gaussian decoder with sigma^2 = D, i.e. still within the paper's model, and keeps the term O(1).
   ``"sum"`` restores the paper's literal scale. Measured: ``recon_reduction=sum`` ends at LM loss 6.84
   against 5.4.

6. **Schedule horizons** (``schedule_steps``, default 10 000; ``tau_schedule_steps``). The paper gives end
   points (tau 2.0 -> 0.3 "short", lambda_p 0.5 -> 0.3 "slow exp/cosine") but no horizon or decay rates.
   Cosine schedules reach their end value at their horizon and stay there. Exponential ones (the paper's
   ``max(tau_min, tau_0 rho^t)``, ``lambda_p^(0) eta^t``, ``max(alpha_floor, alpha_lo^(0) gamma^t)``) take
   their decay factor from the config or, when it is None, derive it so that the end value is reached at
   the horizon; lambda_p's exponential is floored at ``lambda_p_end`` (the table's end point). 10 000
   is the paper's ablation-run length (1/6 of its 60k main run); experiment configs should set it.
   The temperature has a horizon of its own, ``tau_schedule_steps`` (None, the default: ``schedule_steps``,
   tau annealed over the whole run). The paper calls the temperature schedule "short" (Sec. "Temperature
   schedule") without a length; the **"short" preset** is ``tau_schedule_steps = schedule_steps // 10``
   (tau at its end value after the first tenth of the run; the tenth is a choice, the paper gives no
   number), the "full" one ``tau_schedule_steps = None``. Measured: the schedule is not what makes the
   default collapse: tau held at 2.0 (``tau_end=2.0``) gives imbalance 5.0/7.3.
   Every schedule value is a pure function of the ``step`` buffer, so a checkpoint restores it exactly.

7. **Small posterior concentrations** (``posterior_alpha_min``, default 1e-3): added to the softplus bases
   so ``alpha_q >= lambda_q * 1e-3``; Dirichlet sampling gradients blow up as concentrations go to 0.
   (Not in the paper; its "epsilon clamp: off" refers to the router output, which is kept unclamped.)

8. **Decoder** (``decoder_hidden_size``): g_psi is a single ``Linear(E, D)`` with bias by default (the
   paper only says "a single network from the simplex to R^d"); a positive value gives a one-hidden-layer
   SiLU MLP. Posterior heads start at the prior's bases (``softplus(bias) + alpha_min = alpha_hi^(0)`` /
   ``alpha_lo^(0)``).

9. **Reconstruction target: raw or centred** (``recon_target``, ``recon_mean_momentum``, ``recon_weight``).
   The paper reconstructs x itself. Measured, the reconstruction term is what collapses the routing:
   without it (``recon_sigma2=1e9``) imbalance 2.9/2.6 (second seed 2.5/2.5); with all three aux terms off
   2.7/3.5; KL off (``kl_weight=0``) 3.2/5.5; sparsity off (``sparsity_weight=0``) 4.2/4.1. The mechanism:
   the router input becomes dominated by a component shared by all tokens (82-85% of its energy by
   step 100, metric ``input_mean_energy``); every decoder column aligns with that shared mean (metric
   ``decoder_mean_alignment``), and since r sums to one, reconstructing the mean pulls every token's r
   towards the best-fitting column, which is also what picks the expert: a codebook collapse. Subtracting
   the batch mean from the target removed the collapse in two seeds (2.8/2.7 and 3.1/2.2, Switch's level)
   with no balancing loss and the same LM loss. Options:

   * ``"raw"`` (default, the paper): ``||x_t - g_psi(r_t)||^2``.
   * ``"centered"``: the micro-batch mean removed from the target, ``||(x_t - mean_s x_s) - g_psi(r_t)||^2``
     (the prediction is not centred: centring it too would leave the decoder's bias without a gradient).
     With the target attached (gap 3) the mean is attached too.
   * ``"data_mean"``: ``||x_t - (mu + g_psi(r_t))||^2`` with ``mu`` a buffer (not a parameter) holding the
     data mean: the first training micro-batch's mean, then an exponential moving average of the
     micro-batch means with ``recon_mean_momentum`` (default 0.01; updated before use, in training
     forwards only). With momentum 0 it is the decoder's bias initialised at the (first batch's) data
     mean and learned from there (``mu + b``, b starting at 0); with momentum 1 it is ``"centered"`` in
     training. A buffer rather than a parameter set from the data: data-parallel replicas see different
     first batches, and a parameter initialised from them would differ between replicas for the whole
     run; a statistic like BatchNorm's running mean is rank-local by nature (replicas agree within about
     1/momentum steps; a checkpoint keeps its writer's value).

   ``recon_weight`` (default 1) multiplies the term; 0 switches it off (gap 11). ``recon_sigma2`` keeps
   its meaning (the paper's sigma^2); the two only differ in that 0 is a valid weight.

10. **Posterior scale against the KL** (``posterior_scale``). The paper fixes lambda_q by the calibrator
    "to hit a target h" (Sec. "Which lambda to tune?") and lets ``alpha_hi(x)``, ``alpha_lo(x)`` be free
    learned functions (Eq. alpha-q). But only the products ``lambda_q alpha_hi(x)``, ``lambda_q alpha_lo(x)``
    enter the posterior, and ``KL(Dir(alpha_q) || Dir(alpha_p))`` is minimised at ``alpha_q = alpha_p``:
    the heads can and do shrink by lambda_p / lambda_q, undoing the calibration (the Lemma's E[H] depends on
    the bases' total through ``lambda B``). Measured: within ~50 steps the heads absorb the 40x gap
    between lambda_q = 20 and lambda_p = 0.5, the Simpson index of theta rises from 0.18 to 0.92, and the
    sparsity knob no longer sets sparsity during training. The remedy that follows from the equations is
    to make the KL's optimum the calibrated posterior, i.e. one scale for both. Options:

    * ``"free"`` (default, the paper).
    * ``"tied"``: ``lambda_q := lambda_p^(t)``, the posterior at the prior's scale. The prior's scale is
      the knob (the target Simpson index is computed with it). The concentrations are those the KL drives
      ``"free"`` to anyway (``>= lambda_p^(t) * posterior_alpha_min`` ~ 3e-4 at the bound: draws that small
      lose precision in the Gamma sampler).
    * ``"prior_matched"``: the prior at the posterior's scale, ``alpha_p = lambda_q (lambda_p^(t) /
      lambda_p^(0)) (...)``, lambda_p's schedule kept as a relative decay ("mildly decay lambda_p"). lambda_q
      stays the calibrated knob, and at step 0 the posterior already sits at the KL's optimum.
    * ``"normalized"``: ``alpha_q = lambda_q beta(x) B_p(z~) / sum_i beta_i(x)`` with
      ``beta = z~ alpha_hi(x) + (1 - z~) alpha_lo(x)`` and ``B_p(z~) = sum_i (z~_i alpha_hi^(t) +
      (1 - z~_i) alpha_lo^(t))``: the heads set only the posterior's shape and cannot absorb the scale; its
      total is lambda_q times the prior's base total at the same gates, what the calibrator assumes. At
      step 0 it equals ``"free"``. It does not keep the calibrated Simpson index: with the total pinned, the
      KL sharpens the shape instead (prior concentrations below 1 reward near-vertex theta), and by the
      Lemma E[H] -> S2/B^2 for a peaked shape at a large total.

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
    sum to the mean experts per token over k. Like Switch, only in training forwards with grad enabled;
    the metric ``balance_loss`` (coefficient 1) is reported always.

Metrics (all detached; ``[E]`` marks per-expert vectors)
--------------------------------------------------------

The shared ones (:func:`routers.metrics.routing_metrics`: ``active_experts``, ``max_active_experts``,
``unrouted_tokens``, ``simpson``, ``tokens_per_expert`` [E], ``load_imbalance``), and:
``load_share`` [E] (tokens per expert / all dispatches) and ``weight_share`` [E] (mean r per expert, Switch's
P_i); ``fallback_share`` (gap 2); ``dense_phase``; ``dropped_mass``; ``expected_active`` (mean sum of z~);
``recon``, ``kl``, ``sparsity`` (unweighted); ``balance_loss`` (gap 12); ``input_mean_energy``
``= ||mean_t x_t||^2 / mean_t ||x_t||^2``, the share of the input's second moment in the component shared
by all tokens (``mean_t ||x_t||^2 = ||mean x||^2 + mean_t ||x_t - mean x||^2``, so it is in [0, 1]);
``decoder_mean_alignment``, the mean over experts of ``cos(g_psi(e_i) - g_psi(0), mean_t x_t)`` (for the
linear decoder ``g_psi(e_i) - g_psi(0)`` is the i-th column of its weight; ``mu`` of ``"data_mean"`` is not
part of it); ``simpson_r``, ``simpson_theta`` (of the draws); ``simpson_theta_expected`` (the Lemma per token
under the actual posterior, averaged); ``simpson_theta_target`` (the calibrator's target: the Lemma with the
posterior scale in use, ``lambda_q``, or lambda_p^(t) when ``"tied"``, and the prior's current bases on an ideal
active set, ``alpha_hi^(t)`` on k experts and ``alpha_lo^(t)`` on E - k); ``simpson_theta_target_gates``
(the same scale and bases mixed by the actual relaxed gates, per token, averaged: what the posterior's
Simpson index would be had the heads kept the prior's bases); ``lambda_q`` (the scale in use),
``posterior_total`` and ``prior_total`` (mean total concentrations of alpha_q and alpha_p); and the schedule
values ``tau``, ``lambda_p``, ``alpha_lo``, ``alpha_hi``.

Shape suffixes follow :mod:`routers.base` (T tokens, D hidden, E experts).
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
from torch import nn

from routers.base import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind
from routers.metrics import routing_metrics, simpson_index
from routers.registry import register_router

__all__ = [
    "DirMoEConfig",
    "DirMoERouter",
    "DirMoESample",
    "PriorConstants",
    "HPARAM_READINGS",
    "alpha_ratio",
    "dirichlet_expected_simpson",
    "dirichlet_kl",
    "expected_simpson",
    "lambda_for_mass_variance",
    "lambda_for_simpson",
    "reconstruction_loss",
]


# ----------------------------------------------------------------------------------------- paper maths
def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_experts(num_experts: object) -> None:
    if not (isinstance(num_experts, int) and not isinstance(num_experts, bool) and num_experts >= 2):
        raise ValueError(f"num_experts must be an integer >= 2, got {num_experts!r}")


def _check_mass(m: object) -> None:
    if not (_is_number(m) and 0.0 < m < 1.0):
        raise ValueError(f"m (mean mass on the active experts) must be in (0, 1), got {m!r}")


def _check_active_count(name: str, k: object, num_experts: int) -> None:
    if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k < num_experts):
        raise ValueError(f"{name} must be an integer in [1, num_experts - 1 = {num_experts - 1}], got {k!r}")


def _check_positive(name: str, value: object) -> None:
    if not (_is_number(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def alpha_ratio(m: float, num_experts: int, k: int) -> float:
    """The concentration ratio ``r = alpha_hi / alpha_lo`` that puts mean mass ``m`` on k active experts.

    Under ``Dir(alpha)`` with ``alpha_hi`` on k experts and ``alpha_lo`` on the other E - k, the mass on
    the active group is ``Beta(k alpha_hi, (E-k) alpha_lo)`` with mean ``m``; solving gives
    ``r = m/(1-m) (E-k)/k`` (paper Eq. "ratio_r").

    Args:
        m: target mean mass on the active group, in (0, 1).
        num_experts: E >= 2.
        k: active experts, in [1, E-1].

    Returns:
        r > 0 (> 1 exactly when m > k/E).

    Raises:
        ValueError: m outside (0, 1), E < 2, or k outside [1, E-1].
    """
    _check_mass(m)
    _check_experts(num_experts)
    _check_active_count("k", k, num_experts)
    return m / (1.0 - m) * (num_experts - k) / k


def expected_simpson(lam: float, beta: Sequence[float] | torch.Tensor) -> float:
    """Expected Simpson index ``E[sum_i p_i^2]`` for ``p ~ Dir(lam * beta)`` (paper Lemma 1).

    ``E[H] = (lam S2 / B + 1) / (lam B + 1)`` with ``B = sum beta``, ``S2 = sum beta^2``. For E >= 2 it
    decreases strictly in ``lam`` from 1 (``lam -> 0``) to ``sum_i m_i^2``, ``m = beta / B`` (Theorem 1).

    Args:
        lam: the concentration scale lambda > 0.
        beta: the base ``[E]`` (sequence or tensor), every entry > 0.

    Returns:
        The expected Simpson index (a float, computed in float64).

    Raises:
        ValueError: lam <= 0, an empty base, or a non-positive / non-finite base entry.
    """
    _check_positive("lam", lam)
    values = beta.detach().double().flatten().tolist() if isinstance(beta, torch.Tensor) else list(beta)
    if not values:
        raise ValueError("beta must have at least one entry")
    for value in values:
        if not (_is_number(value) and value > 0):
            raise ValueError(f"every beta entry must be a positive finite number, got {value!r}")
    B = math.fsum(values)
    S2 = math.fsum(v * v for v in values)
    return (lam * S2 / B + 1.0) / (lam * B + 1.0)


def lambda_for_simpson(h: float, num_experts: int) -> float:
    """Symmetric calibrator: the lambda for which ``Dir(lambda * 1)`` has expected Simpson index ``h``.

    With ``beta = 1`` the Lemma gives ``E[H] = (lambda + 1)/(lambda E + 1)``, hence
    ``lambda = (1 - h)/(h E - 1)`` (paper Eq. "lambda_from_h").

    Args:
        h: target Simpson index, in (1/E, 1).
        num_experts: E >= 2.

    Returns:
        lambda > 0.

    Raises:
        ValueError: E < 2 or h outside (1/E, 1).
    """
    _check_experts(num_experts)
    if not (_is_number(h) and 1.0 / num_experts < h < 1.0):
        raise ValueError(f"h (target Simpson index) must be in (1/E, 1) = ({1.0 / num_experts:g}, 1), got {h!r}")
    return (1.0 - h) / (h * num_experts - 1.0)


def lambda_for_mass_variance(
    m: float, v_tar: float, s: int, num_experts: int, alpha_hi: float, alpha_lo: float
) -> float:
    """Two-group (Beta) calibrator: the lambda that gives the active-group mass a target variance.

    Under ``Dir(lambda beta)`` with ``beta_i = alpha_hi`` on s experts and ``alpha_lo`` on E - s, the mass
    T on the s experts is ``Beta(lambda s alpha_hi, lambda (E-s) alpha_lo)``, with mean m and variance
    ``m(1-m)/(lambda C + 1)``, ``C = s alpha_hi + (E-s) alpha_lo``. Solving for ``Var(T) = v_tar`` gives
    ``lambda = (m(1-m)/v_tar - 1)/C`` (paper Eq. "lambda_from_beta").

    Args:
        m: the mean active mass, in (0, 1). It must be the mean the bases imply,
            ``s alpha_hi / C`` (within 1e-3): with any other m the returned lambda misses ``v_tar``.
        v_tar: target variance of the active mass, in (0, m(1-m)).
        s: size of the active group, in [1, E-1].
        num_experts: E >= 2.
        alpha_hi: base of the active experts, > 0.
        alpha_lo: base of the inactive experts, > 0.

    Returns:
        lambda > 0.

    Raises:
        ValueError: any argument outside its range, or m inconsistent with the bases.
    """
    _check_mass(m)
    _check_experts(num_experts)
    _check_active_count("s", s, num_experts)
    _check_positive("alpha_hi", alpha_hi)
    _check_positive("alpha_lo", alpha_lo)
    if not (_is_number(v_tar) and 0.0 < v_tar < m * (1.0 - m)):
        raise ValueError(f"v_tar must be in (0, m(1-m)) = (0, {m * (1.0 - m):g}), got {v_tar!r}")
    C = s * alpha_hi + (num_experts - s) * alpha_lo
    implied_m = s * alpha_hi / C
    if abs(implied_m - m) > 1e-3:
        raise ValueError(
            f"m={m!r} does not match the mean active mass {implied_m:.6g} implied by alpha_hi={alpha_hi!r}, "
            f"alpha_lo={alpha_lo!r}, s={s}, E={num_experts} (use alpha_hi = alpha_ratio(m, E, s) * alpha_lo)"
        )
    return (m * (1.0 - m) / v_tar - 1.0) / C


def dirichlet_kl(alpha_q: torch.Tensor, alpha_p: torch.Tensor, validate_args: bool = True) -> torch.Tensor:
    """Closed-form ``KL(Dir(alpha_q) || Dir(alpha_p))``, batched over all but the last dimension.

    ``KL = lgG(sum q) - sum lgG(q) - lgG(sum p) + sum lgG(p) + sum (q - p)(digamma(q) - digamma(sum q))``.
    Differentiable in both arguments.

    Args:
        alpha_q: ``[..., E]`` posterior concentrations, > 0.
        alpha_p: ``[..., E]`` prior concentrations, > 0 (broadcast against ``alpha_q``).
        validate_args: check positivity (a device sync on GPU; the router passes False in its hot path).

    Returns:
        ``[...]`` KL divergences, in the dtype of the inputs.

    Raises:
        ValueError: shapes that do not broadcast, an empty last dimension, or (with ``validate_args``)
            non-positive / non-finite concentrations.
    """
    try:
        shape = torch.broadcast_shapes(alpha_q.shape, alpha_p.shape)
    except RuntimeError as err:
        raise ValueError(f"alpha_q {tuple(alpha_q.shape)} and alpha_p {tuple(alpha_p.shape)} do not broadcast") from err
    if len(shape) == 0 or shape[-1] < 1:
        raise ValueError(f"concentrations need a non-empty last (expert) dimension, got shape {tuple(shape)}")
    if validate_args:
        for name, alpha in (("alpha_q", alpha_q), ("alpha_p", alpha_p)):
            if not bool(torch.isfinite(alpha).all()) or not bool((alpha > 0).all()):
                raise ValueError(f"{name} must be positive and finite")
    alpha_q, alpha_p = torch.broadcast_tensors(alpha_q, alpha_p)
    q0 = alpha_q.sum(-1)
    p0 = alpha_p.sum(-1)
    return (
        torch.lgamma(q0)
        - torch.lgamma(alpha_q).sum(-1)
        - torch.lgamma(p0)
        + torch.lgamma(alpha_p).sum(-1)
        + ((alpha_q - alpha_p) * (torch.digamma(alpha_q) - torch.digamma(q0).unsqueeze(-1))).sum(-1)
    )


def dirichlet_expected_simpson(alpha: torch.Tensor) -> torch.Tensor:
    """The paper's Lemma per row: ``E[sum_i p_i^2]`` for ``p ~ Dir(alpha)``, batched over leading dimensions.

    ``E[H] = sum_i alpha_i (alpha_i + 1) / (alpha_0 (alpha_0 + 1))``, ``alpha_0 = sum_i alpha_i``: the Lemma's
    ``(lam S2 / B + 1) / (lam B + 1)`` with ``alpha = lam beta`` (any split of alpha into lam and beta).

    Args:
        alpha: ``[..., E]`` concentrations, > 0 (not checked: this runs in the router's hot path).

    Returns:
        ``[...]`` expected Simpson indices, in alpha's dtype.
    """
    a0 = alpha.sum(-1)
    return (alpha * (alpha + 1.0)).sum(-1) / (a0 * (a0 + 1.0))


def reconstruction_loss(
    target_TD: torch.Tensor,
    recon_TD: torch.Tensor,
    *,
    sigma2: float = 1.0,
    reduction: str = "mean",
    target: str = "raw",
) -> torch.Tensor:
    """The Gaussian decoder's negative log-likelihood up to a constant, averaged over tokens.

    ``mean_t ||y_t - recon_t||^2 / (2 sigma^2)`` with ``y_t = x_t`` (``target="raw"``, the paper) or
    ``y_t = x_t - mean_s x_s`` (``"centered"``, the micro-batch mean removed; see the module docstring,
    gap 9). ``reduction="mean"`` divides the squared norm by D (the paper's decoder with sigma^2 D, gap 5).

    Args:
        target_TD: ``[T, D]`` the reconstruction target x (detach it beforehand to treat it as data).
        recon_TD: ``[T, D]`` the decoder's output.
        sigma2: the decoder variance sigma^2 > 0.
        reduction: ``"mean"`` or ``"sum"`` over D.
        target: ``"raw"`` or ``"centered"``.

    Returns:
        A scalar, differentiable in both tensors.

    Raises:
        ValueError: an unknown ``reduction`` or ``target``, or shapes that differ.
    """
    if reduction not in _RECON_REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, _RECON_REDUCTIONS))}, got {reduction!r}")
    if target not in ("raw", "centered"):
        raise ValueError(f"target must be 'raw' or 'centered', got {target!r}")
    if target_TD.shape != recon_TD.shape or target_TD.dim() != 2:
        raise ValueError(f"target {tuple(target_TD.shape)} and recon {tuple(recon_TD.shape)} must both be [T, D]")
    if target == "centered":
        target_TD = target_TD - target_TD.mean(0, keepdim=True)
    sq_err_TD = (target_TD - recon_TD).pow(2)
    sq_err_T = sq_err_TD.mean(-1) if reduction == "mean" else sq_err_TD.sum(-1)
    return sq_err_T.mean() / (2.0 * sigma2)


# ------------------------------------------------------------------------------------------- config
#: The two readings of the paper's routing-hyperparameter table: (m, alpha_lo^(0), alpha_floor).
HPARAM_READINGS = types.MappingProxyType(
    {
        "ratio": (0.85, 0.05, 0.005),  # reproduces the table's r = 39.67 and alpha_hi^(0) = 1.98 (E=8, k=1)
        "literal": (0.9, 0.005, 0.005),  # the table's m row and alpha_lo^(0) row as printed
    }
)
_SCHEDULES = ("cosine", "exponential")
_DISPATCH = ("threshold", "topk", "dense")
_RECON_REDUCTIONS = ("mean", "sum")
_RECON_TARGETS = ("raw", "centered", "data_mean")
_GATE_BIAS_INITS = ("tempered", "inclusion")
_POSTERIOR_SCALES = ("free", "tied", "prior_matched", "normalized")


@dataclass(frozen=True)
class PriorConstants:
    """The prior's constants resolved from a :class:`DirMoEConfig` (see :meth:`DirMoEConfig.prior_constants`).

    Attributes:
        mass: m, the prior mean mass on the k active experts.
        ratio: r = alpha_hi / alpha_lo = m/(1-m) (E-k)/k.
        alpha_lo_init: alpha_lo^(0).
        alpha_hi_init: alpha_hi^(0) = r alpha_lo^(0).
        alpha_floor: the floor of alpha_lo^(t).
    """

    mass: float
    ratio: float
    alpha_lo_init: float
    alpha_hi_init: float
    alpha_floor: float


@dataclass(frozen=True)
class DirMoEConfig(RouterConfig):
    """DirMoE's options (defaults: the paper's routing table, gaps closed as the module docstring says).

    Every field is an option of ``build_router("dirmoe", ...)``.
    """

    # ---- gates (spike)
    center_logits: bool = True  # per-token centering of the x-dependent logits; bias added after (gap 1)
    # "tempered" (paper: b = tau_0 logit(k/E)) | "inclusion" (P(z~ >= z_threshold) = k/E at step 0) (gap 1)
    gate_bias_init: str = "tempered"
    tau_start: float = 2.0  # tau_z at step 0 (paper: 2.0)
    tau_end: float = 0.3  # tau_z from the tau horizon on (paper: 0.3)
    tau_schedule: str = "cosine"  # "cosine" (paper table) | "exponential" (paper Eq.: max(tau_min, tau_0 rho^t))
    tau_decay: float | None = None  # rho for "exponential"; None: reach tau_end at tau_schedule_steps
    # horizon of tau alone; None: schedule_steps ("full"); the "short" preset is schedule_steps // 10 (gap 6)
    tau_schedule_steps: int | None = None
    # ---- slab (Dirichlet)
    lambda_q: float = 20.0  # posterior scale lambda^(q) (paper: 20)
    # "free" (paper) | "tied" (lambda_q := lambda_p^(t)) | "prior_matched" (prior at lambda_q's scale) |
    # "normalized" (posterior total pinned to lambda_q x the prior's base total) (gap 10)
    posterior_scale: str = "free"
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

    def __post_init__(self) -> None:
        super().__post_init__()
        E, k = self.num_experts, self.top_k
        if k >= E:
            raise ValueError(f"top_k must be < num_experts={E} for dirmoe (the prior needs inactive experts), got {k}")

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not (_is_number(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")

        def choice(name: str, options: tuple[str, ...]) -> None:
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}, got {getattr(self, name)!r}")

        def flag(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

        def decay(name: str) -> None:
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and 0 < value <= 1):
                raise ValueError(f"{name} must be None or in (0, 1], got {value!r}")

        for name in ("center_logits", "renormalize", "detach_recon_target"):
            flag(name)
        for name in ("tau_start", "tau_end", "lambda_q", "lambda_p_start", "lambda_p_end", "recon_sigma2",
                     "init_std", "posterior_alpha_min", "weight_leak"):
            positive(name)
        for name in ("kl_weight", "sparsity_weight", "recon_weight", "balance_loss_coeff"):
            value = getattr(self, name)
            if not (_is_number(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.tau_end > self.tau_start:
            raise ValueError(f"tau_end must be in (0, tau_start={self.tau_start}], got {self.tau_end}")
        if self.lambda_p_end > self.lambda_p_start:
            raise ValueError(
                f"lambda_p_end must be in (0, lambda_p_start={self.lambda_p_start}], got {self.lambda_p_end}"
            )
        choice("tau_schedule", _SCHEDULES)
        choice("lambda_p_schedule", _SCHEDULES)
        choice("hparam_reading", tuple(HPARAM_READINGS))
        choice("dispatch", _DISPATCH)
        choice("recon_reduction", _RECON_REDUCTIONS)
        choice("recon_target", _RECON_TARGETS)
        choice("gate_bias_init", _GATE_BIAS_INITS)
        choice("posterior_scale", _POSTERIOR_SCALES)
        momentum = self.recon_mean_momentum
        if not (_is_number(momentum) and 0 <= momentum <= 1):
            raise ValueError(f"recon_mean_momentum must be in [0, 1], got {momentum!r}")
        dense = self.dense_steps
        if not (isinstance(dense, int) and not isinstance(dense, bool) and dense >= 0):
            raise ValueError(f"dense_steps must be an integer >= 0, got {dense!r}")
        tau_steps = self.tau_schedule_steps
        if tau_steps is not None and not (isinstance(tau_steps, int) and not isinstance(tau_steps, bool)
                                          and tau_steps >= 1):
            raise ValueError(f"tau_schedule_steps must be None or an integer >= 1, got {tau_steps!r}")
        for name in ("tau_decay", "alpha_decay", "lambda_p_decay"):
            decay(name)
        if not (isinstance(self.schedule_steps, int) and not isinstance(self.schedule_steps, bool)
                and self.schedule_steps >= 1):
            raise ValueError(f"schedule_steps must be an integer >= 1, got {self.schedule_steps!r}")
        if self.prior_mass is not None and not (_is_number(self.prior_mass) and 0 < self.prior_mass < 1):
            raise ValueError(f"prior_mass must be None or in (0, 1), got {self.prior_mass!r}")
        for name in ("alpha_lo_init", "alpha_floor"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0):
                raise ValueError(f"{name} must be None or a positive finite number, got {value!r}")
        prior = self.prior_constants()
        if not prior.mass > k / E:
            # The paper's slab needs alpha_hi > alpha_lo, i.e. r > 1, i.e. m > k/E.
            raise ValueError(
                f"prior_mass (m, from hparam_reading={self.hparam_reading!r} unless set) must be in "
                f"(k/E = {k / E:g}, 1) so that alpha_hi > alpha_lo, got {prior.mass}"
            )
        if prior.alpha_floor > prior.alpha_lo_init:
            raise ValueError(
                f"alpha_floor must be in (0, alpha_lo_init={prior.alpha_lo_init}], got {prior.alpha_floor}"
            )
        if self.posterior_alpha_min >= prior.alpha_lo_init:
            raise ValueError(
                f"posterior_alpha_min must be in (0, alpha_lo_init={prior.alpha_lo_init}), "
                f"got {self.posterior_alpha_min}"
            )
        if not (_is_number(self.z_threshold) and 0 < self.z_threshold < 1):
            raise ValueError(f"z_threshold must be in (0, 1), got {self.z_threshold!r}")
        cap = self.max_experts_per_token
        if cap is not None and not (isinstance(cap, int) and not isinstance(cap, bool) and 1 <= cap <= E):
            raise ValueError(f"max_experts_per_token must be None or an integer in [1, num_experts={E}], got {cap!r}")
        hidden = self.decoder_hidden_size
        if not (isinstance(hidden, int) and not isinstance(hidden, bool) and hidden >= 0):
            raise ValueError(f"decoder_hidden_size must be an integer >= 0, got {hidden!r}")

    @property
    def tau_horizon(self) -> int:
        """Steps over which tau anneals: ``tau_schedule_steps``, or ``schedule_steps`` when it is None."""
        return self.schedule_steps if self.tau_schedule_steps is None else self.tau_schedule_steps

    def prior_constants(self) -> PriorConstants:
        """Resolve m, r, alpha_lo^(0), alpha_hi^(0) and the floor from the reading and the overrides.

        Returns:
            A :class:`PriorConstants`.
        """
        m0, lo0, floor0 = HPARAM_READINGS[self.hparam_reading]
        m = m0 if self.prior_mass is None else self.prior_mass
        lo = lo0 if self.alpha_lo_init is None else self.alpha_lo_init
        floor = floor0 if self.alpha_floor is None else self.alpha_floor
        r = alpha_ratio(m, self.num_experts, self.top_k)
        return PriorConstants(mass=m, ratio=r, alpha_lo_init=lo, alpha_hi_init=r * lo, alpha_floor=floor)

    def dispatch_cap(self) -> int:
        """Most experts the rule ``dispatch`` sends a token to: k for ``"topk"``, E for ``"dense"``, else the
        (resolved) cap of ``"threshold"`` (the dense steps of ``dense_steps`` aside)."""
        if self.dispatch == "topk":
            return self.top_k
        if self.dispatch == "dense":
            return self.num_experts
        if self.max_experts_per_token is not None:
            return self.max_experts_per_token
        return min(self.num_experts, 2 * self.top_k)


# ------------------------------------------------------------------------------------------- router
def _softplus_inverse(y: float) -> float:
    """x with softplus(x) = y (y > 0), written to stay accurate for small y."""
    return y + math.log(-math.expm1(-y))


class _SimplexDecoder(nn.Module):
    """g_psi: the simplex Delta^{E-1} -> R^D, run in float32 whatever the parameters' dtype."""

    def __init__(self, num_experts: int, hidden_size: int, decoder_hidden_size: int) -> None:
        super().__init__()
        hidden = [decoder_hidden_size] if decoder_hidden_size > 0 else []
        widths = [num_experts, *hidden, hidden_size]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def init_weights(self, std: float) -> None:
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=std)
            nn.init.zeros_(layer.bias)

    def forward(self, weights_TE: torch.Tensor) -> torch.Tensor:
        h = weights_TE
        for i, layer in enumerate(self.layers):
            if i > 0:
                h = F.silu(h)
            h = F.linear(h, layer.weight.float(), layer.bias.float())
        return h


@dataclass
class DirMoESample:
    """One draw of DirMoE's latent variables for a micro-batch (all float32, attached to the graph).

    Attributes:
        logits_TE: gate logits l(x) (centred x-dependent part plus bias).
        gates_TE: relaxed gates z~ (``sigmoid(l / tau)`` in eval mode).
        base_q_TE: the posterior's bases, ``alpha_q = lambda_q * base_q`` (``z~ alpha_hi(x) + (1 - z~)
            alpha_lo(x)``, rescaled to the prior's base total under ``posterior_scale="normalized"``).
        lambda_q: the posterior scale in use (``config.lambda_q``, or lambda_p^(t) when tied), a scalar.
        alpha_q_TE: posterior concentrations.
        alpha_p_TE: prior concentrations (built on stop-gradient gates).
        theta_TE: the Dirichlet draw (the posterior mean in eval mode).
        weights_TE: routing weights r = normalize(z~ * theta + eps_w), over all E experts.
        schedule: the schedule values used (``tau``, ``lambda_p``, ``alpha_lo``, ``alpha_hi``).
    """

    logits_TE: torch.Tensor
    gates_TE: torch.Tensor
    base_q_TE: torch.Tensor
    lambda_q: torch.Tensor
    alpha_q_TE: torch.Tensor
    alpha_p_TE: torch.Tensor
    theta_TE: torch.Tensor
    weights_TE: torch.Tensor
    schedule: dict[str, torch.Tensor]


@register_router("dirmoe")
class DirMoERouter(Router):
    """The DirMoE router (see the module docstring for the method and the defaults).

    Parameters: ``weight`` ``[3E, D]`` and ``bias`` ``[3E]`` hold three linear heads on x, rows
    ``[0, E)`` the gate logits, ``[E, 2E)`` the ``alpha_hi`` base and ``[2E, 3E)`` the ``alpha_lo`` base
    (fused so x is read once); ``decoder`` is g_psi. With ``recon_target="data_mean"`` the buffers
    ``recon_mean_D`` (the data mean added to the decoder's output) and ``recon_mean_updates`` (how many
    micro-batches it has seen) hold the running statistic.
    """

    Config = DirMoEConfig
    # The paper's hyper-parameter table for the 185M runs: cosine floor 1e-4 and Adam beta2 0.995 (the
    # baselines keep ReMoE's settings, which is how both papers report them).
    recipe_overrides = {"185m": ("schedule.min_lr=1e-4", "optimizer.beta2=0.995")}

    def __init__(self, config: DirMoEConfig) -> None:
        super().__init__(config)
        E, D = config.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(3 * E, D))
        self.bias = nn.Parameter(torch.empty(3 * E))
        self.decoder = _SimplexDecoder(E, D, config.decoder_hidden_size)
        if config.recon_target == "data_mean":
            # Registered only when used, so checkpoints of the other targets keep their keys.
            self.register_buffer("recon_mean_D", torch.zeros(D))
            self.register_buffer("recon_mean_updates", torch.zeros((), dtype=torch.long))
        # Derived constants (pure functions of the config; the step buffer is the only schedule state).
        self._prior = config.prior_constants()
        T = config.schedule_steps
        self._tau_decay = (
            config.tau_decay
            if config.tau_decay is not None
            else (config.tau_end / config.tau_start) ** (1 / config.tau_horizon)
        )
        self._lambda_p_decay = (
            config.lambda_p_decay
            if config.lambda_p_decay is not None
            else (config.lambda_p_end / config.lambda_p_start) ** (1 / T)
        )
        self._alpha_decay = (
            config.alpha_decay
            if config.alpha_decay is not None
            else (self._prior.alpha_floor / self._prior.alpha_lo_init) ** (1 / T)
        )
        self.reset_parameters()

    def initial_gate_bias(self) -> float:
        """The gate bias at init, per ``gate_bias_init`` (module docstring, gap 1).

        Returns:
            ``tau_0 logit(k/E)`` ("tempered") or ``logit(k/E) + tau_0 logit(z_threshold)`` ("inclusion").
        """
        c = self.config
        pi = c.top_k / self.num_experts
        logit_pi = math.log(pi / (1 - pi))
        if c.gate_bias_init == "inclusion":
            return logit_pi + c.tau_start * math.log(c.z_threshold / (1 - c.z_threshold))
        return c.tau_start * logit_pi

    def reset_parameters(self) -> None:
        """Initialise the heads (gate bias per ``gate_bias_init``, posterior bases at the prior's) and g_psi."""
        c, E = self.config, self.num_experts
        with torch.no_grad():
            nn.init.normal_(self.weight, std=c.init_std)
            self.bias[:E].fill_(self.initial_gate_bias())
            self.bias[E : 2 * E].fill_(_softplus_inverse(self._prior.alpha_hi_init - c.posterior_alpha_min))
            self.bias[2 * E :].fill_(_softplus_inverse(self._prior.alpha_lo_init - c.posterior_alpha_min))
        self.decoder.init_weights(c.init_std)

    # ------------------------------------------------------------------ schedules
    @staticmethod
    def _anneal(
        t: torch.Tensor, start: float, end: float, kind: str, decay: float, horizon: int
    ) -> torch.Tensor:
        if kind == "cosine":
            frac = (t / horizon).clamp(0.0, 1.0)
            return end + (start - end) * 0.5 * (1.0 + torch.cos(math.pi * frac))
        return (start * torch.pow(decay, t)).clamp_min(end)

    def schedule_values(self) -> dict[str, torch.Tensor]:
        """The step-dependent values, as float32 scalars on the step buffer's device.

        Computed in float64 from the ``step`` buffer alone (no host sync), so a restored checkpoint gives
        bit-identical values.

        Returns:
            ``tau`` (gate temperature), ``lambda_p`` (prior scale), ``alpha_lo`` and ``alpha_hi`` (prior
            bases, ``alpha_hi = r alpha_lo``).
        """
        c = self.config
        t = self.step.to(torch.float64)
        tau = self._anneal(t, c.tau_start, c.tau_end, c.tau_schedule, self._tau_decay, c.tau_horizon)
        lambda_p = self._anneal(
            t, c.lambda_p_start, c.lambda_p_end, c.lambda_p_schedule, self._lambda_p_decay, c.schedule_steps
        )
        alpha_lo = (self._prior.alpha_lo_init * torch.pow(self._alpha_decay, t)).clamp_min(self._prior.alpha_floor)
        alpha_hi = self._prior.ratio * alpha_lo
        return {
            "tau": tau.float(),
            "lambda_p": lambda_p.float(),
            "alpha_lo": alpha_lo.float(),
            "alpha_hi": alpha_hi.float(),
        }

    # ------------------------------------------------------------------- forward
    @property
    def constraint(self) -> RoutingConstraint:
        c, E = self.config, self.num_experts
        if c.dispatch == "dense":
            return RoutingConstraint(RoutingKind.EXACT_K, E, E, top_k=c.top_k, probs_sum_to_one=True)
        rule_min = c.top_k if c.dispatch == "topk" else 1
        if c.dense_steps > 0:
            # Both phases: dense (E per token, r sums to one) until dense_steps, then the rule.
            return RoutingConstraint(RoutingKind.VARIABLE, rule_min, E, top_k=c.top_k, probs_sum_to_one=c.renormalize)
        if c.dispatch == "topk":
            return RoutingConstraint(
                RoutingKind.EXACT_K, c.top_k, c.top_k, top_k=c.top_k, probs_sum_to_one=c.renormalize
            )
        return RoutingConstraint(
            RoutingKind.VARIABLE, 1, c.dispatch_cap(), top_k=c.top_k, probs_sum_to_one=c.renormalize
        )

    def sample(self, hidden_TD: torch.Tensor) -> DirMoESample:
        """Draw the gates and the Dirichlet weights for a micro-batch (deterministic in eval mode).

        Args:
            hidden_TD: ``[T, D]`` layer input (any float dtype; the maths runs in float32).

        Returns:
            A :class:`DirMoESample`.
        """
        c, E = self.config, self.num_experts
        sched = self.schedule_values()
        x_TD = hidden_TD.float()
        heads_T3E = F.linear(x_TD, self.weight.float())
        bias_3E = self.bias.float()
        gate_x_TE, hi_TE, lo_TE = heads_T3E.split(E, dim=-1)
        if c.center_logits:
            # Centre only the x-dependent part: centering the bias too would cancel its init (gap 1).
            gate_x_TE = gate_x_TE - gate_x_TE.mean(-1, keepdim=True)
        logits_TE = gate_x_TE + bias_3E[:E]
        alpha_hi_TE = F.softplus(hi_TE + bias_3E[E : 2 * E]) + c.posterior_alpha_min
        alpha_lo_TE = F.softplus(lo_TE + bias_3E[2 * E :]) + c.posterior_alpha_min

        if self.training:
            # Logistic(0, 1) noise by inversion; the clamp keeps log finite (|g| <= ~13.8).
            u_TE = torch.rand_like(logits_TE).clamp(1e-6, 1.0 - 1e-6)
            noise_TE = torch.log(u_TE) - torch.log1p(-u_TE)
            gates_TE = torch.sigmoid((logits_TE + noise_TE) / sched["tau"])
        else:
            gates_TE = torch.sigmoid(logits_TE / sched["tau"])

        base_q_TE = gates_TE * alpha_hi_TE + (1.0 - gates_TE) * alpha_lo_TE
        if c.posterior_scale == "normalized":
            # The heads set the shape only; the total is the prior's base total at the same gates (gap 10).
            base_p_T = (gates_TE * sched["alpha_hi"] + (1.0 - gates_TE) * sched["alpha_lo"]).sum(-1)
            base_q_TE = base_q_TE * (base_p_T / base_q_TE.sum(-1)).unsqueeze(-1)
        lambda_q = sched["lambda_p"] if c.posterior_scale == "tied" else torch.full_like(sched["tau"], c.lambda_q)
        alpha_q_TE = lambda_q * base_q_TE
        lambda_p = sched["lambda_p"]
        if c.posterior_scale == "prior_matched":
            # The prior at the calibrated scale, keeping lambda_p's schedule as a relative decay (gap 10).
            lambda_p = lambda_p * (c.lambda_q / c.lambda_p_start)
        gates_sg_TE = gates_TE.detach()
        alpha_p_TE = lambda_p * (gates_sg_TE * sched["alpha_hi"] + (1.0 - gates_sg_TE) * sched["alpha_lo"])

        if self.training:
            theta_TE = torch.distributions.Dirichlet(alpha_q_TE, validate_args=False).rsample()
        else:
            theta_TE = alpha_q_TE / alpha_q_TE.sum(-1, keepdim=True)

        unnormalised_TE = gates_TE * theta_TE + c.weight_leak
        weights_TE = unnormalised_TE / unnormalised_TE.sum(-1, keepdim=True)
        return DirMoESample(
            logits_TE=logits_TE,
            gates_TE=gates_TE,
            base_q_TE=base_q_TE,
            lambda_q=lambda_q,
            alpha_q_TE=alpha_q_TE,
            alpha_p_TE=alpha_p_TE,
            theta_TE=theta_TE,
            weights_TE=weights_TE,
            schedule=sched,
        )

    def dense_phase(self) -> torch.Tensor:
        """Whether this step dispatches every token to every expert (``dispatch="dense"`` or
        ``step < dense_steps``), as a bool scalar on the step buffer's device (no host sync)."""
        c = self.config
        if c.dispatch == "dense":
            return torch.ones((), dtype=torch.bool, device=self.step.device)
        return self.step < c.dense_steps

    def posterior_bases(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """The posterior's bases ``beta(x) = z~ alpha_hi(x) + (1 - z~) alpha_lo(x)`` at evaluation (deterministic
        gates), i.e. ``alpha_q / lambda_q``: the posterior is ``Dir(lambda_q beta(x))``, so sweeping the scale over
        these bases shows the sparsity knob (``repro.analysis.sparsity_knob``).

        Args:
            hidden_TD: ``[T, D]`` router inputs.

        Returns:
            ``[T, E]`` float32 bases (detached).
        """
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                return self.sample(hidden_TD).alpha_q_TE / self.config.lambda_q
        finally:
            self.train(was_training)

    @property
    def posterior_scale(self) -> float:
        """lambda_q, the posterior's trained concentration scale."""
        return float(self.config.lambda_q)

    def dispatch(self, weights_TE: torch.Tensor, gates_TE: torch.Tensor) -> torch.Tensor:
        """The routing map chosen by ``config.dispatch`` and ``config.dense_steps`` (module docstring, gap 2).

        Args:
            weights_TE: routing weights r.
            gates_TE: relaxed gates z~.

        Returns:
            ``[T, E]`` bool routing map.
        """
        c = self.config
        with torch.no_grad():
            if c.dispatch == "dense":
                return torch.ones_like(weights_TE, dtype=torch.bool)
            if c.dispatch == "topk":
                top_TK = weights_TE.topk(c.top_k, dim=-1).indices
                selected_TE = torch.zeros_like(weights_TE, dtype=torch.bool).scatter_(-1, top_TK, True)
            else:
                selected_TE = gates_TE >= c.z_threshold
                # Every token reaches at least its highest-weighted expert (the fallback).
                selected_TE.scatter_(-1, weights_TE.argmax(-1, keepdim=True), True)
                cap = c.dispatch_cap()
                if cap < self.num_experts:
                    # r > 0 everywhere (eps_w leak), so -1 ranks unselected experts below every selected one.
                    ranked_TE = weights_TE.masked_fill(~selected_TE, -1.0)
                    top_TC = ranked_TE.topk(cap, dim=-1).indices
                    selected_TE &= torch.zeros_like(selected_TE).scatter_(-1, top_TC, True)
            if c.dense_steps > 0:
                # A device-side select rather than a branch on the step: no host sync per forward.
                selected_TE = selected_TE | self.dense_phase()
            return selected_TE

    def route(
        self,
        hidden_TD: torch.Tensor,
        token_ids_T: torch.Tensor | None = None,
        seq_shape: tuple[int, int] | None = None,
    ) -> RouterOutput:
        """Route one micro-batch (see :meth:`Router.route`); token ids and sequence shape are unused."""
        # Router maths stays float32 even inside an autocast region (paper: "router logits/Dirichlet in fp32").
        with torch.autocast(device_type=hidden_TD.device.type, enabled=False):
            return self._route_fp32(hidden_TD)

    def _recon_offset(self, mean_D: torch.Tensor) -> torch.Tensor | None:
        """``recon_target="data_mean"``: update the running data mean (training forwards only) and return it."""
        if self.config.recon_target != "data_mean":
            return None
        if self.training:
            with torch.no_grad():
                # The first micro-batch sets the mean; later ones move it by the momentum. torch.where keeps
                # this free of host syncs (the update count lives on the device).
                first = self.recon_mean_updates == 0
                momentum = torch.where(first, 1.0, self.config.recon_mean_momentum).to(mean_D.dtype)
                self.recon_mean_D.lerp_(mean_D.detach().to(self.recon_mean_D.dtype), momentum)
                self.recon_mean_updates.add_(1)
        # A copy: later in-place updates must not change what this forward's graph used.
        return self.recon_mean_D.float().clone()

    def decoder_directions(self) -> torch.Tensor:
        """``g_psi(e_i) - g_psi(0)`` for every expert i, ``[E, D]`` float32 (the linear decoder's columns).

        Returns:
            The direction each expert's vertex of the simplex adds to the reconstruction (detached).
        """
        with torch.no_grad():
            E = self.num_experts
            vertices_ED = self.decoder(torch.eye(E, device=self.bias.device))
            origin_1D = self.decoder(torch.zeros(1, E, device=self.bias.device))
            return vertices_ED - origin_1D

    def _route_fp32(self, hidden_TD: torch.Tensor) -> RouterOutput:
        c, E, k = self.config, self.num_experts, self.top_k
        T = hidden_TD.shape[0]
        s = self.sample(hidden_TD)
        routing_map_TE = self.dispatch(s.weights_TE, s.gates_TE)
        probs_TE = torch.where(routing_map_TE, s.weights_TE, torch.zeros_like(s.weights_TE))
        kept_T = probs_TE.sum(-1)
        if c.renormalize:
            probs_TE = probs_TE / kept_T.unsqueeze(-1)

        x_TD = hidden_TD.float()
        mean_D = x_TD.detach().mean(0)
        # Reconstruction -log N(x; g_psi(r), sigma^2 I) up to a constant, per token (gaps 3, 5, 9).
        target_TD = x_TD.detach() if c.detach_recon_target else x_TD
        with torch.set_grad_enabled(torch.is_grad_enabled() and c.recon_weight > 0):
            recon_TD = self.decoder(s.weights_TE)
            offset_D = self._recon_offset(mean_D)
            if offset_D is not None:
                recon_TD = recon_TD + offset_D
            recon = reconstruction_loss(
                target_TD,
                recon_TD,
                sigma2=c.recon_sigma2,
                reduction=c.recon_reduction,
                target="centered" if c.recon_target == "centered" else "raw",
            )
        kl = dirichlet_kl(s.alpha_q_TE, s.alpha_p_TE, validate_args=False).mean()
        active_T = s.gates_TE.sum(-1)
        sparsity = (active_T - k).pow(2).mean()

        # A term whose weight is 0 is left out: no backward through it (gap 11).
        aux_losses = {
            name: weight * value
            for name, weight, value in (
                ("dirmoe_recon", c.recon_weight, recon),
                ("dirmoe_kl", c.kl_weight, kl),
                ("dirmoe_sparsity", c.sparsity_weight, sparsity),
            )
            if weight > 0
        }
        tokens_per_expert_E = routing_map_TE.sum(0)
        if c.balance_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            # Switch's loss exactly as megatron-core computes it, on r (all E) and DirMoE's map (gap 12).
            aux_losses["load_balancing_loss"] = switch_load_balancing_loss_func(
                probs=s.weights_TE,
                tokens_per_expert=tokens_per_expert_E,
                total_num_tokens=T,
                topk=k,
                num_experts=E,
                moe_aux_loss_coeff=c.balance_loss_coeff,
            )

        metrics = routing_metrics(probs_TE, routing_map_TE)
        with torch.no_grad():
            dense_T = self.dense_phase().expand(T)
            if c.dispatch == "threshold":
                fallback_T = ~(s.gates_TE >= c.z_threshold).any(-1) & ~dense_T
            else:
                fallback_T = torch.zeros_like(dense_T)
            sq_norm_mean = x_TD.pow(2).sum(-1).mean()
            directions_ED = self.decoder_directions()
            alignment = F.cosine_similarity(directions_ED, mean_D.detach().expand_as(directions_ED), dim=-1).mean()
            # The calibrator's target: the Lemma with the scale in use and the prior's bases on an ideal
            # active set (k experts at alpha_hi^(t), E - k at alpha_lo^(t)).
            a_hi, a_lo, lam = s.schedule["alpha_hi"], s.schedule["alpha_lo"], s.lambda_q.detach()
            B = k * a_hi + (E - k) * a_lo
            S2 = k * a_hi * a_hi + (E - k) * a_lo * a_lo
            gates_TE = s.gates_TE.detach()
            prior_bases_TE = gates_TE * a_hi + (1.0 - gates_TE) * a_lo
            alpha_q_TE = s.alpha_q_TE.detach()
            metrics.update(
                load_share=tokens_per_expert_E.float() / tokens_per_expert_E.sum().clamp_min(1).float(),
                weight_share=s.weights_TE.detach().mean(0),
                fallback_share=fallback_T.float().mean(),
                dense_phase=self.dense_phase().float(),
                expected_active=active_T.mean().detach(),
                dropped_mass=(1.0 - kept_T).mean().detach(),
                kl=kl.detach(),
                recon=recon.detach(),
                sparsity=sparsity.detach(),
                balance_loss=switch_load_balancing_loss_func(
                    s.weights_TE.detach(), tokens_per_expert_E, T, k, E, 1.0
                ),
                input_mean_energy=mean_D.pow(2).sum() / sq_norm_mean.clamp_min(1e-30),
                decoder_mean_alignment=alignment,
                simpson_r=simpson_index(s.weights_TE),
                simpson_theta=simpson_index(s.theta_TE),
                simpson_theta_expected=dirichlet_expected_simpson(alpha_q_TE).mean(),
                simpson_theta_target=(lam * S2 / B + 1.0) / (lam * B + 1.0),
                simpson_theta_target_gates=dirichlet_expected_simpson(lam * prior_bases_TE).mean(),
                lambda_q=lam,
                posterior_total=alpha_q_TE.sum(-1).mean(),
                prior_total=s.alpha_p_TE.detach().sum(-1).mean(),
                **{name: value.detach() for name, value in s.schedule.items()},
            )
        return RouterOutput(probs=probs_TE, routing_map=routing_map_TE, aux_losses=aux_losses, metrics=metrics)
