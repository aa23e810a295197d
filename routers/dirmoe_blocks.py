"""DirMoE's sample (gates, concentrations, Dirichlet draw, routing weights, sparsity and KL terms) as a function
of tensors with a closed-form backward for eager training, and what inductor needs (``compile_elementwise``).
Shape suffixes: :mod:`routers.base`.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings

import torch
import torch.nn.functional as F

from routers.dirichlet import kl_terms


def _c_compiler() -> str | None:
    """The host C compiler Triton would build its launchers with (``$CC``, else gcc, else clang), or None."""
    cc = os.environ.get("CC")
    return shutil.which(cc) if cc else shutil.which("gcc") or shutil.which("clang")


def _cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would use (its own search list), or None."""
    from torch._inductor import config as inductor_config

    cxx = inductor_config.cpp.cxx if isinstance(inductor_config.cpp.cxx, (list, tuple)) else (inductor_config.cpp.cxx,)
    # None in the list stands for a conda install, which inductor skips by default.
    return next((path for path in (shutil.which(c) for c in cxx if c) if path), None)


def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def inductor_available(device: torch.device) -> tuple[bool, str]:
    """Whether torch.compile's inductor can generate code for ``device``.

    Returns:
        ``(available, missing)``, ``missing`` naming what lacks ("" if none).
    """
    if device.type == "cuda":
        missing = [name for name, ok in (("Triton", _has_triton()), ("a C compiler ($CC, gcc or clang)", _c_compiler()))
                   if not ok]
    elif device.type == "cpu":
        missing = [] if _cxx_compiler() else ["a C++ compiler (inductor's cpp.cxx)"]
    else:
        missing = [f"an inductor backend for {device.type}"]
    return not missing, " and ".join(missing)


@functools.cache
def warn_eager_fallback(device_type: str, missing: str) -> None:
    """Warn (once per process and cause) that ``compile_elementwise="auto"`` runs eager for lack of ``missing``."""
    warnings.warn(
        f"DirMoE runs eager on {device_type}: torch.compile needs {missing}, which is missing "
        "(compile_elementwise='auto'; 'never' silences this)",
        stacklevel=3,
    )


def routing_sample(
    x_TD: torch.Tensor, weight_3ED: torch.Tensor, bias_3E: torch.Tensor, u_TE: torch.Tensor | None, tau: torch.Tensor,
    prior_alpha_hi: torch.Tensor, prior_alpha_lo: torch.Tensor, lambda_q: torch.Tensor, lambda_p: torch.Tensor, *,
    num_experts: int, top_k: int, center_logits: bool, alpha_min: float, normalized: bool, weight_leak: float,
    sparsity_weight: float, kl_weight: float,
) -> tuple[torch.Tensor, ...]:
    """Gates, concentrations, Dirichlet draw, routing weights, sparsity and KL terms from x; eager training
    (``normalized`` off) with :class:`_RoutingSample`'s closed-form backward, else autograd.

    Args:
        x_TD: router input, float32.
        weight_3ED: the three heads' weight (gate, alpha_hi, alpha_lo), float32.
        bias_3E: the heads' bias.
        u_TE: uniforms of the Logistic noise (training); None: noise-free gates, posterior mean (evaluation).
        tau: gate temperature.
        prior_alpha_hi, prior_alpha_lo: the prior's alpha_hi^(t), alpha_lo^(t).
        lambda_q, lambda_p: posterior and prior scales in use.
        num_experts: E.
        top_k: k, the sparsity term's target.
        center_logits: centre the x-dependent logits per token (gap 1).
        alpha_min: ``posterior_alpha_min`` (gap 7).
        normalized: ``posterior_scale="normalized"`` (gap 10).
        weight_leak: eps_w.
        sparsity_weight, kl_weight: folded into the sparsity and KL terms' last ops (no product of their own).

    Returns:
        :class:`routers.dirmoe.DirMoESample`'s first ten fields, ``logits_TE`` to ``kl`` (gradients: see there).
    """
    args = (x_TD, weight_3ED, bias_3E, u_TE, tau, prior_alpha_hi, prior_alpha_lo, lambda_q, lambda_p, num_experts,
            top_k, center_logits, alpha_min, weight_leak, sparsity_weight, kl_weight)
    if u_TE is not None and not normalized and not torch.compiler.is_compiling():
        return _RoutingSample.apply(*args)
    return _forward(*args, normalized=normalized, draw=_rsample)[0]


def _rsample(alpha_TE: torch.Tensor) -> torch.Tensor:
    return torch.distributions.Dirichlet(alpha_TE, validate_args=False).rsample()


def _forward(x_TD, weight_3ED, bias_3E, u_TE, tau, prior_hi, prior_lo, lambda_q, lambda_p, E, top_k, center,
             alpha_min, weight_leak, sparsity_weight, kl_weight, *, normalized, draw):
    """:func:`routing_sample`'s expression (``draw``: theta from alpha_q in training); returns ``(outputs, saved)``,
    ``saved`` the intermediates :meth:`_RoutingSample.backward` reads."""
    heads_T3E = F.linear(x_TD, weight_3ED)
    # One bias add, then the split (three slices and adds would triple the launches, both ways).
    logits_TE, bases_T2E = (heads_T3E + bias_3E).split([E, 2 * E], dim=-1)
    if center:
        # Centre only the x-dependent part: centering the bias too would cancel its init (gap 1).
        logits_TE = logits_TE - heads_T3E[:, :E].mean(-1, keepdim=True)
    alpha_hi_TE, alpha_lo_TE = (F.softplus(bases_T2E) + alpha_min).split(E, dim=-1)
    if u_TE is not None:
        # Logistic(0, 1) noise by inversion, logit(u) with u clamped to [1e-6, 1 - 1e-6] (|g| <= ~13.8), one op.
        gates_TE = torch.sigmoid((logits_TE + torch.logit(u_TE, eps=1e-6)) / tau)
    else:
        gates_TE = torch.sigmoid(logits_TE / tau)
    # z alpha_hi + (1 - z) alpha_lo as one lerp (one op, not four).
    base_q_TE = torch.lerp(alpha_lo_TE, alpha_hi_TE, gates_TE)
    if normalized:
        # The heads set the shape only; the total is the prior's base total at the same gates (gap 10).
        base_p_T = (gates_TE * prior_hi + (1.0 - gates_TE) * prior_lo).sum(-1)
        base_q_TE = base_q_TE * (base_p_T / base_q_TE.sum(-1)).unsqueeze(-1)
    alpha_q_TE = lambda_q * base_q_TE
    with torch.no_grad():  # the prior sees sg(z~)
        alpha_p_TE = lambda_p * torch.lerp(prior_lo, prior_hi, gates_TE)
    theta_TE = draw(alpha_q_TE) if u_TE is not None else alpha_q_TE / alpha_q_TE.sum(-1, keepdim=True)
    unnormalised_TE = gates_TE * theta_TE + weight_leak
    active_T1 = gates_TE.sum(-1, keepdim=True)
    T = x_TD.shape[0]
    total_T1 = unnormalised_TE.sum(-1, keepdim=True)
    weights_TE = unnormalised_TE / total_T1
    excess_T1 = active_T1 - top_k
    sparsity = excess_T1.pow(2).sum() * (sparsity_weight / T)
    q0_T1 = alpha_q_TE.sum(-1, keepdim=True)
    kl_TE1, C_TE1, delta_TE1 = kl_terms(alpha_q_TE, alpha_p_TE, q0_T1)
    kl = kl_TE1.sum() * (kl_weight / T)
    return ((logits_TE, gates_TE, base_q_TE, alpha_q_TE, alpha_p_TE, theta_TE, weights_TE, active_T1, sparsity, kl),
            (bases_T2E, alpha_hi_TE, alpha_lo_TE, gates_TE, alpha_q_TE, q0_T1, theta_TE, unnormalised_TE, total_T1,
             excess_T1, C_TE1, delta_TE1))


class _RoutingSample(torch.autograd.Function):
    """:func:`routing_sample` in eager training (``normalized`` off) with a closed-form backward (a few ops per
    term instead of autograd's op-by-op backward).

    Forward (``h = x W^T + b = [h_l, h_hi, h_lo]``): ``l = h_l - mean_i (x W_l^T)_i`` (centred, else ``h_l``),
    ``[a_hi, a_lo] = softplus([h_hi, h_lo]) + alpha_min``, ``z = sigmoid((l + logit(u)) / tau)``,
    ``alpha_q = lambda_q (z a_hi + (1 - z) a_lo)``, ``alpha_p`` (no gradient), ``r = v / S``, ``v = z theta + eps``,
    ``theta = torch._sample_dirichlet(alpha_q)`` (``Dirichlet.rsample``'s draws), ``S = sum_i v_i``,
    ``s = w_s mean_t (sum_i z_i - k)^2``, ``kl = w_kl mean_t KL_t`` (:func:`~routers.dirichlet.kl_terms`). Backward:

    * ``g_v = (g_r - <g_r, v> / S) / S``; ``g_theta = g_v z``;
    * ``g_alpha_q = dtheta/dalpha_q (g_theta - <g_theta, theta>)`` (the implicit reparameterisation gradient,
      ``torch._dirichlet_grad``, as ``Dirichlet.rsample``'s backward) ``+ (w_kl g_kl / T) ((q - p) psi'(q) -
      (q0 - p0) psi'(q0))`` (``q0``, ``p0`` the totals, ``psi'`` the trigamma function);
    * ``g_base = lambda_q g_alpha_q``; ``g_z = g_v theta + g_base (a_hi - a_lo) + (2 w_s g_s / T) (sum_i z_i - k)``;
    * ``g_l = g_z z (1 - z) / tau``; ``g_[h_hi, h_lo] = [g_base z, g_base (1 - z)] sigmoid([h_hi, h_lo])``;
    * ``g_b = sum_t g_h``; ``g_heads = g_h`` with ``g_l - mean_i g_l`` when centred; ``g_x = g_heads W``,
      ``g_W = g_heads^T x``.
    """

    @staticmethod
    def forward(ctx, x_TD, weight_3ED, bias_3E, u_TE, tau, prior_hi, prior_lo, lambda_q, lambda_p, E, top_k,
                center, alpha_min, weight_leak, sparsity_weight, kl_weight):
        ctx.set_materialize_grads(False)
        outputs, saved = _forward(x_TD, weight_3ED, bias_3E, u_TE, tau, prior_hi, prior_lo, lambda_q, lambda_p, E,
                                  top_k, center, alpha_min, weight_leak, sparsity_weight, kl_weight,
                                  normalized=False, draw=torch._sample_dirichlet)
        ctx.save_for_backward(x_TD, weight_3ED, *saved)
        T = x_TD.shape[0]
        ctx.tau, ctx.lambda_q, ctx.center = tau, lambda_q, center
        ctx.sparsity_scale, ctx.kl_scale = 2.0 * sparsity_weight / T, kl_weight / T
        ctx.mark_non_differentiable(*outputs[:6], outputs[7])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        g_weights_TE, g_sparsity, g_kl = grads[6], grads[8], grads[9]
        (x_TD, weight_3ED, bases_T2E, alpha_hi_TE, alpha_lo_TE, gates_TE, alpha_q_TE, q0_T1, theta_TE,
         unnormalised_TE, total_T1, excess_T1, C_TE1, delta_TE1) = ctx.saved_tensors
        E = gates_TE.shape[-1]
        if g_weights_TE is None:  # a loss without the weights
            g_weights_TE = torch.zeros_like(gates_TE)
        dot_T1 = (g_weights_TE * unnormalised_TE).sum(-1, keepdim=True)
        g_v_TE = torch.addcdiv(g_weights_TE, dot_T1, total_T1, value=-1) / total_T1
        g_theta_TE = g_v_TE * gates_TE
        g_alpha_TE = torch._dirichlet_grad(theta_TE, alpha_q_TE, q0_T1) * (
            g_theta_TE - (theta_TE * g_theta_TE).sum(-1, keepdim=True))
        if g_kl is not None:
            g_q_TE, g_0_T1 = (delta_TE1 * torch.polygamma(1, C_TE1)).split([E, 1], -1)
            g_alpha_TE = torch.addcmul(g_alpha_TE, g_q_TE + g_0_T1, g_kl, value=ctx.kl_scale)
        g_base_TE = g_alpha_TE * ctx.lambda_q
        g_z_TE = torch.addcmul(g_v_TE * theta_TE, g_base_TE, alpha_hi_TE - alpha_lo_TE)
        if g_sparsity is not None:
            g_z_TE = torch.addcmul(g_z_TE, excess_T1, g_sparsity, value=ctx.sparsity_scale)
        g_logits_TE = torch.ops.aten.sigmoid_backward(g_z_TE, gates_TE) / ctx.tau
        g_hi_TE = g_base_TE * gates_TE
        g_bases_T2E = torch.ops.aten.softplus_backward(torch.cat([g_hi_TE, g_base_TE - g_hi_TE], -1), bases_T2E, 1, 20)
        g_bias_3E = torch.cat([g_logits_TE, g_bases_T2E], -1).sum(0)
        if ctx.center:
            g_logits_TE = g_logits_TE - g_logits_TE.mean(-1, keepdim=True)
        g_heads_T3E = torch.cat([g_logits_TE, g_bases_T2E], -1)
        g_x_TD = g_heads_T3E.mm(weight_3ED) if ctx.needs_input_grad[0] else None
        return g_x_TD, g_heads_T3E.t().mm(x_TD), g_bias_3E, *(None,) * 13
