"""DirMoE: the Dirichlet-routed Mixture-of-Experts router (Vahidi et al., "DirMoE: Dirichlet-Routed Mixture
of Experts", ICLR 2026 submission), written from the paper (no public code).

Method (paper Sec. 4 and Appendix "Objective function"), per token x (the MoE layer's input):

* Heads on x: gate logits ``l(x)`` and positive posterior bases ``alpha_hi(x)``, ``alpha_lo(x)`` (softplus), in R^E.
* Relaxed spike (binary concrete / Gumbel-sigmoid): ``z~ = sigmoid((l + g) / tau_z)``, ``g ~ Logistic(0,1)``.
* Slab posterior ``Dir(alpha_q)``, ``alpha_q = lambda_q (z~ alpha_hi(x) + (1 - z~) alpha_lo(x))``, sampled
  as ``torch.distributions.Dirichlet(...).rsample()`` does (normalised Gamma, implicit reparameterisation).
* Slab prior ``Dir(alpha_p)``, ``alpha_p = lambda_p^(t) (sg(z~) alpha_hi^(t) + (1 - sg(z~)) alpha_lo^(t))``
  with scheduled constants ``alpha_hi^(t) = r alpha_lo^(t)``, ``r = m/(1-m) (E-k)/k``.
* Routing weights ``r = normalize(z~ * theta + eps_w)``.
* Loss (mean over tokens): ``||x - g_psi(r)||^2 / (2 sigma^2) + beta_theta KL(Dir(alpha_q) || Dir(alpha_p))
  + lambda_sparsity (sum_i z~_i - k)^2``, returned as the aux losses ``dirmoe_recon``, ``dirmoe_kl`` and
  ``dirmoe_sparsity`` (each already weighted).
* Evaluation (``router.eval()``) is deterministic: no logistic noise, ``theta`` = the posterior mean.
* All router maths runs in float32 whatever the model dtype (training computes :meth:`DirMoERouter.route_core`).

Dirichlet maths: :mod:`routers.dirichlet`; the sample's maths: :mod:`routers.dirmoe_blocks`; options:
:mod:`routers.dirmoe_config` (the paper's numbered gaps: docs/routers.md). Shape suffixes: :mod:`routers.base`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
from torch import nn

from routers import dirmoe_blocks as blocks
from routers.base import Router, RouterOutput, RoutingConstraint, RoutingKind
from routers.dirichlet import dirichlet_expected_simpson, reconstruction_loss
from routers.dirmoe_config import DirMoEConfig
from routers.metrics import simpson_index
from routers.registry import register_router


def _softplus_inverse(y: float) -> float:
    """x with softplus(x) = y (y > 0), written to stay accurate for small y."""
    return y + math.log(-math.expm1(-y))


def _anneal(t: torch.Tensor, start: float, end: float, kind: str, decay: float | None, horizon: int) -> torch.Tensor:
    """Cosine from ``start`` to ``end`` over ``horizon``, else ``max(end, start decay^t)`` (``decay`` None: reaching
    ``end`` at ``horizon``, gap 6)."""
    if kind == "cosine":
        frac = (t / horizon).clamp(0.0, 1.0)
        return end + (start - end) * 0.5 * (1.0 + torch.cos(math.pi * frac))
    decay = (end / start) ** (1 / horizon) if decay is None else decay
    return (start * torch.pow(decay, t)).clamp_min(end)


class _SimplexDecoder(nn.Module):
    """g_psi: the simplex Delta^{E-1} -> R^D, ``Linear`` layers with SiLU between, in float32."""

    def __init__(self, num_experts: int, hidden_size: int, decoder_hidden_size: int) -> None:
        super().__init__()
        widths = [num_experts, *([decoder_hidden_size] if decoder_hidden_size > 0 else []), hidden_size]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, weights_TE: torch.Tensor) -> torch.Tensor:
        h = weights_TE
        for i, layer in enumerate(self.layers):
            h = F.linear(F.silu(h) if i > 0 else h, layer.weight.float(), layer.bias.float())
        return h


@dataclass
class DirMoESample:
    """One draw of DirMoE's latents for a micro-batch, with the sparsity and KL terms (float32; which carry
    gradients: :func:`routers.dirmoe_blocks.routing_sample`)."""

    logits_TE: torch.Tensor  # gate logits l(x) (centred x-dependent part plus bias)
    gates_TE: torch.Tensor  # relaxed gates z~ (sigmoid(l / tau) in eval mode)
    base_q_TE: torch.Tensor  # alpha_q / lambda_q = z~ alpha_hi(x) + (1 - z~) alpha_lo(x) (rescaled if "normalized")
    alpha_q_TE: torch.Tensor  # posterior concentrations
    alpha_p_TE: torch.Tensor  # prior concentrations (built on stop-gradient gates)
    theta_TE: torch.Tensor  # the Dirichlet draw (the posterior mean in eval mode)
    weights_TE: torch.Tensor  # routing weights r = normalize(z~ * theta + eps_w), over all E experts
    active_T1: torch.Tensor  # sum_i z~_i per token
    sparsity: torch.Tensor  # the sparsity term mean (sum_i z~_i - k)^2 times sparsity_weight (1 when that is 0)
    kl: torch.Tensor  # the KL term mean KL(Dir(alpha_q) || Dir(alpha_p)) times kl_weight (1 when that is 0)
    lambda_q: torch.Tensor  # the posterior scale in use (config.lambda_q, or lambda_p^(t) when tied), a scalar
    schedule: dict[str, torch.Tensor]  # the schedule values used (DirMoERouter.schedule_values)


@register_router("dirmoe")
class DirMoERouter(Router):
    """The DirMoE router (options: :class:`DirMoEConfig`). ``weight`` ``[3E, D]``, ``bias`` ``[3E]``: three fused
    heads (x read once), rows ``[0, E)`` gate logits, ``[E, 2E)`` / ``[2E, 3E)`` the ``alpha_hi`` / ``alpha_lo``
    bases; ``decoder``: g_psi; ``"data_mean"`` adds buffers ``recon_mean_D`` and ``recon_mean_updates`` (count)."""

    Config = DirMoEConfig
    # The paper's Appendix "Hyperparameters" (baselines keep ReMoE's settings, as both papers report them).
    recipe_overrides = {"185m": ("optimizer.lr=1e-4", "schedule.min_lr=1e-5", "optimizer.beta2=0.995")}
    # The suite's remedy for the small-scale collapse (gap 9), not the paper's method: run beside it as a variant.
    variants = {"centered": ("router.options.recon_target=centered",)}

    def __init__(self, config: DirMoEConfig) -> None:
        super().__init__(config)
        E, D = config.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(3 * E, D))
        self.bias = nn.Parameter(torch.empty(3 * E))
        self.decoder = _SimplexDecoder(E, D, config.decoder_hidden_size)
        if config.recon_target == "data_mean":
            # Only when used, so the other targets' checkpoints keep their keys.
            self.register_buffer("recon_mean_D", torch.zeros(D))
            self.register_buffer("recon_mean_updates", torch.zeros((), dtype=torch.long))
        self._prior = config.prior_constants()
        self._inductor: dict[str, tuple[bool, str]] = {}  # device type -> (inductor can compile there, what lacks)
        self._schedule_cache: tuple | None = None  # (step, its _version, inference mode, values): _step_schedule
        self.reset_parameters()

    def initial_gate_bias(self) -> float:
        """The gate bias at init, per ``gate_bias_init`` (gap 1): ``tau_0 logit(k/E)`` ("tempered") or
        ``logit(k/E) + tau_0 logit(z_threshold)`` ("inclusion")."""
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
            for layer in self.decoder.layers:
                nn.init.normal_(layer.weight, std=c.init_std)
                nn.init.zeros_(layer.bias)

    def schedule_values(self) -> dict[str, torch.Tensor]:
        """The step-dependent values, in float64 from the ``step`` buffer alone (no host sync; bit-identical after
        a restore).

        Returns:
            float32 scalars: ``tau``, ``lambda_p``, ``lambda_q`` (``lambda_p`` when tied, else the constant),
            ``alpha_lo`` and ``alpha_hi = r alpha_lo`` (prior bases).
        """
        c, prior = self.config, self._prior
        t = self.step.to(torch.float64)
        tau = _anneal(t, c.tau_start, c.tau_end, c.tau_schedule, c.tau_decay, c.tau_horizon)
        lambda_p = _anneal(t, c.lambda_p_start, c.lambda_p_end, c.lambda_p_schedule, c.lambda_p_decay, c.schedule_steps)
        lambda_p = lambda_p.float()
        alpha_lo = _anneal(t, prior.alpha_lo_init, prior.alpha_floor, "exponential", c.alpha_decay, c.schedule_steps)
        return {
            "tau": tau.float(),
            "lambda_p": lambda_p,
            "lambda_q": lambda_p if c.posterior_scale == "tied" else torch.full_like(lambda_p, c.lambda_q),
            "alpha_lo": alpha_lo.float(),
            "alpha_hi": (prior.ratio * alpha_lo).float(),
        }

    def _step_schedule(self) -> dict[str, torch.Tensor]:
        """:meth:`schedule_values`, cached when eager. Sync-free key: the buffer (a new one from ``.to(device)``
        never matches), its version (bumped by ``set_step``, ``load_state_dict``) and inference mode (its tensors
        may not enter a training graph)."""
        if torch.compiler.is_compiling():
            return self.schedule_values()
        step, inference = self.step, torch.is_inference_mode_enabled()
        cache = self._schedule_cache
        if cache is None or not (cache[0] is step and cache[1] == step._version and cache[2] == inference):
            cache = self._schedule_cache = (step, step._version, inference, self.schedule_values())
        return cache[3]

    def compiles_elementwise(self, device: torch.device) -> bool:
        """Whether the forward runs as one ``torch.compile`` region on ``device`` (``compile_elementwise``).

        Raises:
            ValueError: ``"always"`` where inductor lacks what the device needs (named).
        """
        mode = self.config.compile_elementwise
        if mode == "never" or (mode == "auto" and device.type != "cuda"):
            return False
        if device.type not in self._inductor:
            self._inductor[device.type] = blocks.inductor_available(device)
        available, missing = self._inductor[device.type]
        if available:
            return True
        if mode == "auto":
            blocks.warn_eager_fallback(device.type, missing)
            return False
        raise ValueError(
            f"compile_elementwise='always' cannot compile on {device.type}: {missing} is missing; use 'auto' or 'never'"
        )

    @property
    def constraint(self) -> RoutingConstraint:
        c, E = self.config, self.num_experts
        if c.dispatch == "dense":
            return RoutingConstraint(RoutingKind.EXACT_K, E, E, top_k=c.top_k, probs_sum_to_one=True)
        least = c.top_k if c.dispatch == "topk" else 1
        # With dense steps the constraint spans both phases: dense (E per token), then the rule.
        most = E if c.dense_steps > 0 else c.dispatch_cap()
        kind = RoutingKind.EXACT_K if c.dispatch == "topk" and c.dense_steps == 0 else RoutingKind.VARIABLE
        return RoutingConstraint(kind, least, most, top_k=c.top_k, probs_sum_to_one=c.renormalize)

    def sample(self, hidden_TD: torch.Tensor, u_TE: torch.Tensor | None = None) -> DirMoESample:
        """Draw the gates and the Dirichlet weights for a micro-batch (deterministic in eval mode).

        Args:
            hidden_TD: ``[T, D]`` layer input (any float dtype).
            u_TE: ``[T, E]`` gate-noise uniforms (training); None: drawn here (by inductor when compiled).
        """
        c, E = self.config, self.num_experts
        sched = self._step_schedule()
        x_TD = hidden_TD.float()
        if not self.training:
            u_TE = None
        elif u_TE is None:
            u_TE = torch.rand(x_TD.shape[0], E, dtype=x_TD.dtype, device=x_TD.device)
        lambda_p = sched["lambda_p"]
        if c.posterior_scale == "prior_matched":
            # The prior at the calibrated scale; lambda_p's schedule kept as a relative decay (gap 10).
            lambda_p = lambda_p * (c.lambda_q / c.lambda_p_start)
        return DirMoESample(
            *blocks.routing_sample(
                x_TD, self.weight.float(), self.bias.float(), u_TE, sched["tau"], sched["alpha_hi"], sched["alpha_lo"],
                sched["lambda_q"], lambda_p, num_experts=E, top_k=self.top_k, center_logits=c.center_logits,
                alpha_min=c.posterior_alpha_min, normalized=c.posterior_scale == "normalized",
                weight_leak=c.weight_leak,
                # Weighted as aux losses; a term left out of the loss (weight 0) is still reported, unweighted.
                sparsity_weight=c.sparsity_weight or 1.0, kl_weight=c.kl_weight or 1.0,
            ),
            lambda_q=sched["lambda_q"],
            schedule=sched,
        )

    def dense_phase(self) -> torch.Tensor:
        """Whether this step dispatches densely (``dispatch="dense"`` or ``step < dense_steps``): a device bool."""
        if self.config.dispatch == "dense":
            return torch.ones((), dtype=torch.bool, device=self.step.device)
        return self.step < self.config.dense_steps

    def posterior_bases(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """The ``[T, E]`` float32 bases ``beta(x)`` (detached) of the eval posterior
        ``Dir(posterior_scale * beta(x))`` of ``[T, D]`` router inputs (``repro.analysis``)."""
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                return self.sample(hidden_TD).base_q_TE
        finally:
            self.train(was_training)

    @property
    def posterior_scale(self) -> float:
        """The posterior's scale now: ``lambda_q``, or lambda_p^(t) when tied."""
        if self.config.posterior_scale == "tied":
            return float(self.schedule_values()["lambda_p"])
        return float(self.config.lambda_q)

    def dispatch(self, weights_TE: torch.Tensor, gates_TE: torch.Tensor) -> torch.Tensor:
        """The ``[T, E]`` bool routing map of routing weights r and relaxed gates z~ by ``config.dispatch`` and
        ``config.dense_steps`` (gap 2)."""
        c = self.config
        with torch.no_grad():
            if c.dispatch == "dense":
                return torch.ones_like(weights_TE, dtype=torch.bool)
            if c.dispatch == "topk":
                top_TK = weights_TE.topk(c.top_k, dim=-1).indices
                selected_TE = torch.zeros_like(weights_TE, dtype=torch.bool).scatter_(-1, top_TK, True)
            else:
                # The fallback: every token reaches at least its highest-weighted expert.
                best = weights_TE.max(-1, keepdim=True)
                cap = c.dispatch_cap()
                if cap >= self.num_experts:
                    selected_TE = (gates_TE >= c.z_threshold).scatter_(-1, best.indices, True)
                else:
                    # -1 off the selection: r > 0 (eps_w), so the cap's top-k keeps only selected experts.
                    ranked_TE = weights_TE.masked_fill(gates_TE < c.z_threshold, -1.0)
                    top = ranked_TE.scatter_(-1, best.indices, best.values).topk(cap, dim=-1)
                    selected_TE = torch.zeros_like(gates_TE, dtype=torch.bool)
                    selected_TE.scatter_(-1, top.indices, top.values >= 0)
            if c.dense_steps > 0:
                # A device-side select, not a branch on the step: no host sync.
                selected_TE = selected_TE | self.dense_phase()
            return selected_TE

    def route(
        self, hidden_TD: torch.Tensor, token_ids_T: torch.Tensor | None = None, seq_shape: tuple[int, int] | None = None
    ) -> RouterOutput:
        """Route one micro-batch (see :meth:`Router.route`); token ids and sequence shape are unused."""
        # float32 even under autocast (paper: "router logits/Dirichlet in fp32").
        with torch.autocast(device_type=hidden_TD.device.type, enabled=False):
            return self._route_fp32(hidden_TD)

    def _recon_offset(self, mean_D: torch.Tensor) -> torch.Tensor:
        """``recon_target="data_mean"``: update the running data mean (training forwards only) and return it."""
        if self.training:
            with torch.no_grad():
                # The first micro-batch sets the mean, later ones move it by the momentum (torch.where: no sync).
                first = self.recon_mean_updates == 0
                momentum = torch.where(first, 1.0, self.config.recon_mean_momentum).to(mean_D.dtype)
                self.recon_mean_D.lerp_(mean_D.detach().to(self.recon_mean_D.dtype), momentum)
                self.recon_mean_updates.add_(1)
        # A copy: later in-place updates must not change what this forward's graph used.
        return self.recon_mean_D.float().clone()

    def decoder_directions(self) -> torch.Tensor:
        """``[E, D]`` ``g_psi(e_i) - g_psi(0)`` (detached): what each vertex adds (a linear decoder's columns)."""
        with torch.no_grad():
            E = self.num_experts
            vertices_ED = self.decoder(torch.eye(E, device=self.bias.device))
            return vertices_ED - self.decoder(torch.zeros(1, E, device=self.bias.device))

    def _route_fp32(self, hidden_TD: torch.Tensor, u_TE: torch.Tensor | None = None) -> RouterOutput:
        """:meth:`route_core` (compiled where :meth:`compiles_elementwise`), then the metrics, eagerly (they sync;
        leaving them out changes nothing the training computes)."""
        core = _compiled_route_core() if self.compiles_elementwise(hidden_TD.device) else _route_core
        probs_TE, routing_map_TE, aux_losses, parts = core(self, hidden_TD, u_TE)
        return self.output(
            probs_TE, routing_map_TE, aux_losses, lambda: self._metrics(hidden_TD, routing_map_TE, parts)
        )

    def route_core(
        self, hidden_TD: torch.Tensor, u_TE: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Everything the training computes from the ``[T, D]`` layer input, without host syncs (the compiled
        region); ``u_TE``: as :meth:`sample`.

        Returns:
            ``(probs_TE, routing_map_TE, aux_losses, parts)``; ``parts``: what :meth:`_metrics` reads.
        """
        c, E, k = self.config, self.num_experts, self.top_k
        s = self.sample(hidden_TD, u_TE)
        routing_map_TE = self.dispatch(s.weights_TE, s.gates_TE)
        x_TD = hidden_TD.float()
        offset_D = self._recon_offset(x_TD.detach().mean(0)) if c.recon_target == "data_mean" else None
        # r where dispatched, exactly 0 elsewhere (r is finite): one op each way.
        probs_TE = s.weights_TE * routing_map_TE
        if c.renormalize:
            probs_TE = probs_TE / probs_TE.sum(-1, keepdim=True)
        # Reconstruction -log N(x; g_psi(r), sigma^2 I) up to a constant, per token (gaps 3, 5, 9).
        with torch.set_grad_enabled(torch.is_grad_enabled() and c.recon_weight > 0):
            recon_TD = self.decoder(s.weights_TE)
            if offset_D is not None:
                recon_TD = recon_TD + offset_D
            recon = reconstruction_loss(
                x_TD.detach() if c.detach_recon_target else x_TD, recon_TD, sigma2=c.recon_sigma2,
                reduction=c.recon_reduction, target="centered" if c.recon_target == "centered" else "raw",
            )

        # Weight 0 leaves a term out (gap 11). Eager skips x * 1.0 (exact); compiled keeps it (an aliasing output
        # costs launches outside the region).
        recon_term = recon if c.recon_weight == 1.0 and not torch.compiler.is_compiling() else c.recon_weight * recon
        terms = (("dirmoe_recon", c.recon_weight, recon_term), ("dirmoe_kl", c.kl_weight, s.kl),
                 ("dirmoe_sparsity", c.sparsity_weight, s.sparsity))
        aux_losses = {name: value for name, weight, value in terms if weight > 0}
        if c.balance_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            # megatron-core's Switch loss on r (all E) and DirMoE's map (gap 12).
            aux_losses["load_balancing_loss"] = switch_load_balancing_loss_func(
                s.weights_TE, routing_map_TE.sum(0), hidden_TD.shape[0], k, E, c.balance_loss_coeff
            )
        parts = {
            "gates_TE": s.gates_TE, "weights_TE": s.weights_TE, "theta_TE": s.theta_TE, "alpha_q_TE": s.alpha_q_TE,
            "alpha_p_TE": s.alpha_p_TE, "active_T1": s.active_T1, "recon": recon, "kl": s.kl, "sparsity": s.sparsity,
            **s.schedule,
        }
        if torch.compiler.is_compiling():
            # Detached (an output requiring grad costs a zero-gradient launch); terms copied (aliases cost launches).
            parts = {name: value.detach().clone() if name in ("kl", "sparsity") else value.detach()
                     for name, value in parts.items()}
        return probs_TE, routing_map_TE, aux_losses, parts

    def _metrics(
        self, hidden_TD: torch.Tensor, routing_map_TE: torch.Tensor, p: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """DirMoE's diagnostic metrics (docs/routers.md, "Metrics") from :meth:`route_core`'s outputs."""
        c, E, k = self.config, self.num_experts, self.top_k
        T = hidden_TD.shape[0]
        with torch.no_grad():
            x_TD = hidden_TD.float()
            tokens_per_expert_E = routing_map_TE.sum(0)
            mean_D = x_TD.mean(0)
            dense_T = self.dense_phase().expand(T)
            if c.dispatch == "threshold":
                fallback_T = ~(p["gates_TE"] >= c.z_threshold).any(-1) & ~dense_T
            else:
                fallback_T = torch.zeros_like(dense_T)
            directions_ED = self.decoder_directions()
            a_hi, a_lo, lam = p["alpha_hi"], p["alpha_lo"], p["lambda_q"].detach()
            B = k * a_hi + (E - k) * a_lo
            S2 = k * a_hi * a_hi + (E - k) * a_lo * a_lo
            gates_TE, weights_TE, alpha_q_TE = (p[name].detach() for name in ("gates_TE", "weights_TE", "alpha_q_TE"))
            prior_bases_TE = gates_TE * a_hi + (1.0 - gates_TE) * a_lo
            alignment_E = F.cosine_similarity(directions_ED, mean_D.expand_as(directions_ED), dim=-1)
            return dict(
                load_share=tokens_per_expert_E.float() / tokens_per_expert_E.sum().clamp_min(1).float(),
                weight_share=weights_TE.mean(0),
                fallback_share=fallback_T.float().mean(),
                dense_phase=self.dense_phase().float(),
                expected_active=p["active_T1"].mean().detach(),
                dropped_mass=(1.0 - (weights_TE * routing_map_TE).sum(-1)).mean(),
                kl=p["kl"].detach() / (c.kl_weight or 1.0),
                recon=p["recon"].detach(),
                sparsity=p["sparsity"].detach() / (c.sparsity_weight or 1.0),
                balance_loss=switch_load_balancing_loss_func(weights_TE, tokens_per_expert_E, T, k, E, 1.0),
                input_mean_energy=mean_D.pow(2).sum() / x_TD.pow(2).sum(-1).mean().clamp_min(1e-30),
                decoder_mean_alignment=alignment_E.mean(),
                simpson_r=simpson_index(p["weights_TE"]),
                simpson_theta=simpson_index(p["theta_TE"]),
                simpson_theta_expected=dirichlet_expected_simpson(alpha_q_TE).mean(),
                simpson_theta_target=(lam * S2 / B + 1.0) / (lam * B + 1.0),
                simpson_theta_target_gates=dirichlet_expected_simpson(lam * prior_bases_TE).mean(),
                lambda_q=lam,
                posterior_total=alpha_q_TE.sum(-1).mean(),
                prior_total=p["alpha_p_TE"].detach().sum(-1).mean(),
                **{name: p[name].detach() for name in ("tau", "lambda_p", "alpha_lo", "alpha_hi")},
            )


# One compiled function for every layer (dynamo guards on the options, not the router's identity).
_route_core = DirMoERouter.route_core


@functools.cache
def _compiled_route_core():
    """``torch.compile`` of :meth:`DirMoERouter.route_core`, on first use (importing dynamo is slow)."""
    return torch.compile(_route_core)
