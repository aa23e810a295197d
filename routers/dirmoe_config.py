"""DirMoE's options (:class:`DirMoEConfig`): the paper's routing table, and its gaps closed with switchable
defaults; the comments' "gap N" is the numbered list in docs/routers.md ("DirMoE's gaps and their defaults"; its
evidence: "...: what was measured"; ``compile_elementwise``: "Implementation option (not the maths)").
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

from routers.base import RouterConfig, is_int, require
from routers.dirichlet import RECON_REDUCTIONS, alpha_ratio, is_finite_number

#: The two readings of the paper's routing-hyperparameter table: (m, alpha_lo^(0), alpha_floor).
HPARAM_READINGS = types.MappingProxyType({
    "ratio": (0.85, 0.05, 0.005),  # reproduces the table's r = 39.67 and alpha_hi^(0) = 1.98 (E=8, k=1)
    "literal": (0.9, 0.005, 0.005),  # the table's m row and alpha_lo^(0) row as printed
})
_SCHEDULES = ("cosine", "exponential")
_DISPATCH = ("threshold", "topk", "dense")
_RECON_TARGETS = ("raw", "centered", "data_mean")
_GATE_BIAS_INITS = ("tempered", "inclusion")
_POSTERIOR_SCALES = ("free", "tied", "prior_matched", "normalized")
_COMPILE_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class PriorConstants:
    """The prior's constants (:meth:`DirMoEConfig.prior_constants`)."""

    mass: float  # m, the prior mean mass on the k active experts
    ratio: float  # r = alpha_hi / alpha_lo = m/(1-m) (E-k)/k
    alpha_lo_init: float  # alpha_lo^(0)
    alpha_hi_init: float  # alpha_hi^(0) = r alpha_lo^(0)
    alpha_floor: float  # the floor of alpha_lo^(t)


@dataclass(frozen=True)
class DirMoEConfig(RouterConfig):
    """DirMoE's options, each a ``build_router("dirmoe", ...)`` keyword (the gaps they close: docs/routers.md)."""

    # ---- gates (spike)
    center_logits: bool = True  # per-token centering of the x-dependent logits; bias added after (gap 1)
    gate_bias_init: str = "tempered"  # "tempered" (paper: b = tau_0 logit(k/E)) | "inclusion" (gap 1)
    tau_start: float = 2.0  # tau_z at step 0 (paper: 2.0)
    tau_end: float = 0.3  # tau_z from the tau horizon on (paper: 0.3)
    tau_schedule: str = "cosine"  # "cosine" (paper table) | "exponential" (paper Eq.: max(tau_min, tau_0 rho^t))
    tau_decay: float | None = None  # rho for "exponential"; None: reach tau_end at tau_schedule_steps
    tau_schedule_steps: int | None = None  # tau's horizon; None: schedule_steps; "short": // 10 (gap 6)
    # ---- slab (Dirichlet)
    lambda_q: float = 20.0  # posterior scale lambda^(q) (paper: 20)
    posterior_scale: str = "free"  # "free" (paper) | "tied" | "prior_matched" | "normalized" (gap 10)
    hparam_reading: str = "ratio"  # "ratio" | "literal": which reading of the paper's table (gap 4)
    prior_mass: float | None = None  # m; None: from hparam_reading (0.85 ratio / 0.9 literal)
    alpha_lo_init: float | None = None  # alpha_lo^(0); None: from hparam_reading (0.05 / 0.005)
    alpha_floor: float | None = None  # floor of alpha_lo^(t); None: from hparam_reading (0.005 / 0.005)
    alpha_decay: float | None = None  # gamma in max(floor, alpha_lo^(0) gamma^t); None: floor at schedule_steps
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
    compile_elementwise: str = "auto"  # "auto" | "always" | "never": one torch.compile region or eager

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
              "weight_leak", lambda v: is_finite_number(v) and v > 0, "a positive finite number")
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
        check("dense_steps decoder_hidden_size", lambda v: is_int(v) and v >= 0, "an integer >= 0")
        check("tau_schedule_steps", lambda v: v is None or (is_int(v) and v >= 1), "None or an integer >= 1")
        check("tau_decay alpha_decay lambda_p_decay", lambda v: v is None or (is_finite_number(v) and 0 < v <= 1),
              "None or in (0, 1]")
        check("schedule_steps", lambda v: is_int(v) and v >= 1, "an integer >= 1")
        check("prior_mass", lambda v: v is None or (is_finite_number(v) and 0 < v < 1), "None or in (0, 1)")
        check("alpha_lo_init alpha_floor", lambda v: v is None or (is_finite_number(v) and v > 0),
              "None or a positive finite number")
        prior = self.prior_constants()
        if not prior.mass > k / E:
            raise ValueError(  # the paper's slab needs alpha_hi > alpha_lo, i.e. r > 1, i.e. m > k/E
                f"prior_mass (m, from hparam_reading={self.hparam_reading!r} unless set) must be in "
                f"(k/E = {k / E:g}, 1) so that alpha_hi > alpha_lo, got {prior.mass}"
            )
        require(prior.alpha_floor <= prior.alpha_lo_init, "alpha_floor", prior.alpha_floor,
                f"in (0, alpha_lo_init={prior.alpha_lo_init}]")
        require(self.posterior_alpha_min < prior.alpha_lo_init, "posterior_alpha_min", self.posterior_alpha_min,
                f"in (0, alpha_lo_init={prior.alpha_lo_init})")
        check("z_threshold", lambda v: is_finite_number(v) and 0 < v < 1, "in (0, 1)")
        check("max_experts_per_token", lambda v: v is None or (is_int(v) and 1 <= v <= E),
              f"None or an integer in [1, num_experts={E}]")

    @property
    def tau_horizon(self) -> int:
        """Steps over which tau anneals: ``tau_schedule_steps``, or ``schedule_steps`` when it is None."""
        return self.schedule_steps if self.tau_schedule_steps is None else self.tau_schedule_steps

    def prior_constants(self) -> PriorConstants:
        """The :class:`PriorConstants` of ``hparam_reading`` and the overrides."""
        m0, lo0, floor0 = HPARAM_READINGS[self.hparam_reading]
        m = m0 if self.prior_mass is None else self.prior_mass
        lo = lo0 if self.alpha_lo_init is None else self.alpha_lo_init
        floor = floor0 if self.alpha_floor is None else self.alpha_floor
        r = alpha_ratio(m, self.num_experts, self.top_k)
        return PriorConstants(mass=m, ratio=r, alpha_lo_init=lo, alpha_hi_init=r * lo, alpha_floor=floor)

    def dispatch_cap(self) -> int:
        """Most experts ``dispatch`` sends a token to (``dense_steps`` aside): k, E, or the threshold rule's cap."""
        if self.dispatch == "threshold":
            cap = self.max_experts_per_token
            return min(self.num_experts, 2 * self.top_k) if cap is None else cap
        return self.top_k if self.dispatch == "topk" else self.num_experts
