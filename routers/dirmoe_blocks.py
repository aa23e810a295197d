"""DirMoE's elementwise maths as pure functions of tensors, called by :meth:`routers.dirmoe.DirMoERouter.route_core`
(eager, or inside its one compiled region: option ``compile_elementwise``), and the checks of what inductor needs.

- :func:`gates_and_concentrations`: gate logits, relaxed gates z~, posterior bases and the posterior / prior
  concentrations;
- :func:`combine_and_losses`: combine weights on the routing map and the three (unweighted) loss terms;
- :func:`simplex_decode`: the decoder g_psi in float32;
- :func:`inductor_available`: whether inductor can generate code on a device, and what it lacks;
  :func:`warn_eager_fallback`: the one warning of ``compile_elementwise="auto"`` falling back to eager.

Shape suffixes follow :mod:`routers.base` (T tokens, D hidden, E experts).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from routers.dirichlet import dirichlet_kl, dirichlet_kl_mean, reconstruction_loss


def simplex_decode(weights_TE: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """g_psi(r) in float32: ``Linear`` layers with SiLU between them.

    Args:
        weights_TE: routing weights r.
        params: ``(weight_0, bias_0, weight_1, bias_1, ...)`` of the decoder's layers.

    Returns:
        The reconstruction [T, D] in float32.
    """
    h = weights_TE
    for i in range(0, len(params), 2):
        if i > 0:
            h = F.silu(h)
        h = F.linear(h, params[i].float(), params[i + 1].float())
    return h


def _c_compiler() -> str | None:
    """The host C compiler Triton would build its launchers with (``$CC``, else gcc, else clang), or None."""
    import os
    import shutil

    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("clang")


def _cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would use (its own search list), or None."""
    import shutil

    from torch._inductor import config as inductor_config

    cxx = inductor_config.cpp.cxx if isinstance(inductor_config.cpp.cxx, (list, tuple)) else (inductor_config.cpp.cxx,)
    # None in the list stands for a conda install that inductor does not do by default.
    return next((path for path in (shutil.which(c) for c in cxx if c) if path), None)


def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def inductor_available(device: torch.device) -> tuple[bool, str]:
    """Whether torch.compile's inductor can generate code for ``device``.

    Returns:
        ``(available, missing)``: ``missing`` names what is lacking ("" when available): on CUDA Triton and
        the host C compiler Triton builds with; on CPU a C++ compiler.
    """
    if device.type == "cuda":
        missing = [name for name, ok in (("Triton", _has_triton()), ("a C compiler ($CC, gcc or clang)", _c_compiler()))
                   if not ok]
    elif device.type == "cpu":
        missing = [] if _cxx_compiler() else ["a C++ compiler (inductor's cpp.cxx)"]
    else:
        missing = [f"an inductor backend for {device.type}"]
    return not missing, " and ".join(missing)


_WARNED: set[str] = set()


def warn_eager_fallback(device: torch.device, missing: str) -> None:
    """Warn once per process and device type that ``compile_elementwise="auto"`` runs eager for lack of
    ``missing``."""
    if device.type not in _WARNED:
        _WARNED.add(device.type)
        warnings.warn(
            f"DirMoE runs eager on {device.type}: torch.compile needs {missing}, which is missing "
            "(compile_elementwise='auto'; 'never' silences this)",
            stacklevel=3,
        )


def gates_and_concentrations(
    heads_T3E: torch.Tensor,
    bias_3E: torch.Tensor,
    u_TE: torch.Tensor | None,
    tau: torch.Tensor,
    prior_alpha_hi: torch.Tensor,
    prior_alpha_lo: torch.Tensor,
    lambda_q: torch.Tensor,
    lambda_p: torch.Tensor,
    *,
    num_experts: int,
    center_logits: bool,
    alpha_min: float,
    normalized: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate logits, relaxed gates and the posterior's and prior's concentrations from the heads' outputs.

    Args:
        heads_T3E: ``x W^T`` of the three heads (gate, alpha_hi, alpha_lo), float32.
        bias_3E: the heads' bias.
        u_TE: uniforms for the Logistic(0, 1) noise (training), or None (evaluation: noise-free gates).
        tau: the gate temperature.
        prior_alpha_hi: alpha_hi^(t) of the prior.
        prior_alpha_lo: alpha_lo^(t) of the prior.
        lambda_q: the posterior scale in use.
        lambda_p: the prior scale in use.
        num_experts: E.
        center_logits: centre the x-dependent logits per token (gap 1).
        alpha_min: ``posterior_alpha_min`` (gap 7).
        normalized: ``posterior_scale="normalized"`` (gap 10).

    Returns:
        ``(logits_TE, gates_TE, base_q_TE, alpha_q_TE, alpha_p_TE)``.
    """
    E = num_experts
    # One add of the three heads' bias, then the split: three slices and adds cost three times the launches,
    # forward and backward.
    logits_TE, hi_TE, lo_TE = (heads_T3E + bias_3E).split(E, dim=-1)
    if center_logits:
        # Centre only the x-dependent part: centering the bias too would cancel its init (gap 1).
        logits_TE = logits_TE - heads_T3E[:, :E].mean(-1, keepdim=True)
    alpha_hi_TE = F.softplus(hi_TE) + alpha_min
    alpha_lo_TE = F.softplus(lo_TE) + alpha_min
    if u_TE is not None:
        # Logistic(0, 1) noise by inversion; the clamp keeps log finite (|g| <= ~13.8).
        # logit(u) = log(u) - log(1 - u), clamped to [1e-6, 1 - 1e-6] first, in one op.
        noise_TE = torch.logit(u_TE, eps=1e-6)
        gates_TE = torch.sigmoid((logits_TE + noise_TE) / tau)
    else:
        gates_TE = torch.sigmoid(logits_TE / tau)
    # z alpha_hi + (1 - z) alpha_lo as one lerp (one op forward where the sum of products takes four).
    base_q_TE = torch.lerp(alpha_lo_TE, alpha_hi_TE, gates_TE)
    if normalized:
        # The heads set the shape only; the total is the prior's base total at the same gates (gap 10).
        base_p_T = (gates_TE * prior_alpha_hi + (1.0 - gates_TE) * prior_alpha_lo).sum(-1)
        base_q_TE = base_q_TE * (base_p_T / base_q_TE.sum(-1)).unsqueeze(-1)
    alpha_q_TE = lambda_q * base_q_TE
    gates_sg_TE = gates_TE.detach()
    alpha_p_TE = lambda_p * torch.lerp(prior_alpha_lo, prior_alpha_hi, gates_sg_TE)
    return logits_TE, gates_TE, base_q_TE, alpha_q_TE, alpha_p_TE


def combine_and_losses(
    weights_TE: torch.Tensor,
    routing_map_TE: torch.Tensor,
    gates_TE: torch.Tensor,
    alpha_q_TE: torch.Tensor,
    alpha_p_TE: torch.Tensor,
    target_TD: torch.Tensor,
    offset_D: torch.Tensor | None,
    decoder_params: tuple[torch.Tensor, ...],
    *,
    top_k: int,
    renormalize: bool,
    recon_grad: bool,
    sigma2: float,
    reduction: str,
    centered: bool,
) -> tuple[torch.Tensor, ...]:
    """Combine weights on the routing map, and the three loss terms (unweighted).

    Args:
        weights_TE: routing weights r.
        routing_map_TE: the dispatch map.
        gates_TE: relaxed gates z~.
        alpha_q_TE: posterior concentrations.
        alpha_p_TE: prior concentrations.
        target_TD: the reconstruction target (x, detached under ``detach_recon_target``).
        offset_D: the ``"data_mean"`` offset added to the decoder's output, or None.
        decoder_params: g_psi's parameters (:meth:`routers.dirmoe._SimplexDecoder.params`).
        top_k: k.
        renormalize: rescale the dispatched weights to sum to one.
        recon_grad: whether the reconstruction term takes part in the backward (``recon_weight > 0``).
        sigma2: ``recon_sigma2``.
        reduction: ``recon_reduction``.
        centered: ``recon_target="centered"``.

    Returns:
        ``(probs_TE, kept_T, recon, kl, active_T, sparsity)``: the combine weights, the dispatched weight
        mass per token, the reconstruction term, ``mean KL(Dir(alpha_q) || Dir(alpha_p))``, ``sum_i z~_i`` per
        token and ``mean (sum_i z~_i - k)^2``.
    """
    probs_TE = torch.where(routing_map_TE, weights_TE, 0.0)
    kept_T = probs_TE.sum(-1)
    if renormalize:
        probs_TE = probs_TE / kept_T.unsqueeze(-1)
    # Reconstruction -log N(x; g_psi(r), sigma^2 I) up to a constant, per token (gaps 3, 5, 9).
    with torch.set_grad_enabled(torch.is_grad_enabled() and recon_grad):
        recon_TD = simplex_decode(weights_TE, decoder_params)
        if offset_D is not None:
            recon_TD = recon_TD + offset_D
        recon = reconstruction_loss(
            target_TD, recon_TD, sigma2=sigma2, reduction=reduction, target="centered" if centered else "raw"
        )
    if torch.compiler.is_compiling():
        # Inductor fuses the expression and its autograd backward into a few kernels itself.
        kl = dirichlet_kl(alpha_q_TE, alpha_p_TE, validate_args=False).mean()
    else:
        # Eager: the closed-form backward, a few ops instead of autograd's forty.
        kl = dirichlet_kl_mean(alpha_q_TE, alpha_p_TE)
    active_T = gates_TE.sum(-1)
    sparsity = (active_T - top_k).pow(2).mean()
    return probs_TE, kept_T, recon, kl, active_T, sparsity
