"""The DirMoE paper's Dirichlet maths, public and tested on its own: the concentration ratio, the Lemma and its
calibrators, the closed-form Dirichlet KL, and the reconstruction term. The public functions raise ``ValueError``
naming an argument outside the range its Args give. Shape suffixes: :mod:`routers.base`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from routers.base import is_int, require

#: How the reconstruction's squared error is reduced over the D dimensions (see ``DirMoEConfig.recon_reduction``).
RECON_REDUCTIONS = ("mean", "sum")


def is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_positive(name: str, value: object) -> None:
    require(is_finite_number(value) and value > 0, name, value, "a positive finite number")


def _check_experts(num_experts: object) -> None:
    require(is_int(num_experts) and num_experts >= 2, "num_experts", num_experts, "an integer >= 2")


def _check_mass_and_count(m: object, num_experts: object, name: str, k: object) -> None:
    """m in (0, 1), E >= 2 and the active count ``name`` = k in [1, E-1], checked in that order."""
    require(is_finite_number(m) and 0.0 < m < 1.0, "m (mean mass on the active experts)", m, "in (0, 1)")
    _check_experts(num_experts)
    require(is_int(k) and 1 <= k < num_experts, name, k, f"an integer in [1, num_experts - 1 = {num_experts - 1}]")


def alpha_ratio(m: float, num_experts: int, k: int) -> float:
    """``r = alpha_hi / alpha_lo`` putting mean mass ``m`` on k active experts: their mass is ``Beta(k alpha_hi,
    (E-k) alpha_lo)``, so ``r = m/(1-m) (E-k)/k`` (paper Eq. "ratio_r").

    Args:
        m: mean mass on the active group, in (0, 1).
        num_experts: E >= 2.
        k: active experts, in [1, E-1].

    Returns:
        r > 0 (> 1 exactly when m > k/E).
    """
    _check_mass_and_count(m, num_experts, "k", k)
    return m / (1.0 - m) * (num_experts - k) / k


def expected_simpson(lam: float, beta: Sequence[float] | torch.Tensor) -> float:
    """Paper Lemma 1: ``E[sum_i p_i^2] = (lam S2 / B + 1) / (lam B + 1)`` for ``p ~ Dir(lam * beta)``, ``B = sum
    beta``, ``S2 = sum beta^2``; strictly decreasing in ``lam`` (E >= 2) from 1 to ``sum_i (beta_i / B)^2``.

    Args:
        lam: concentration scale lambda > 0.
        beta: ``[E]`` base (sequence or tensor), non-empty, entries > 0 and finite.

    Returns:
        A float (computed in float64).
    """
    _check_positive("lam", lam)
    values = beta.detach().double().flatten().tolist() if isinstance(beta, torch.Tensor) else list(beta)
    if not values:
        raise ValueError("beta must have at least one entry")
    for value in values:
        _check_positive("every beta entry", value)
    B = math.fsum(values)
    S2 = math.fsum(v * v for v in values)
    return (lam * S2 / B + 1.0) / (lam * B + 1.0)


def lambda_for_simpson(h: float, num_experts: int) -> float:
    """Symmetric calibrator: lambda with ``E[H] = h`` under ``Dir(lambda * 1)``. The Lemma's
    ``(lambda + 1)/(lambda E + 1)`` gives ``lambda = (1 - h)/(h E - 1)`` (paper Eq. "lambda_from_h").

    Args:
        h: target Simpson index, in (1/E, 1).
        num_experts: E >= 2.

    Returns:
        lambda > 0.
    """
    _check_experts(num_experts)
    ok = is_finite_number(h) and 1.0 / num_experts < h < 1.0
    require(ok, "h (target Simpson index)", h, f"in (1/E, 1) = ({1.0 / num_experts:g}, 1)")
    return (1.0 - h) / (h * num_experts - 1.0)


def lambda_for_mass_variance(
    m: float, v_tar: float, s: int, num_experts: int, alpha_hi: float, alpha_lo: float
) -> float:
    """Two-group (Beta) calibrator: lambda giving the active mass variance ``v_tar``. That mass is
    ``Beta(lambda s alpha_hi, lambda (E-s) alpha_lo)``, variance ``m(1-m)/(lambda C + 1)``, ``C = s alpha_hi +
    (E-s) alpha_lo``, so ``lambda = (m(1-m)/v_tar - 1)/C`` (paper Eq. "lambda_from_beta").

    Args:
        m: mean active mass in (0, 1); must be ``s alpha_hi / C`` (within 1e-3), else lambda misses ``v_tar``.
        v_tar: target variance, in (0, m(1-m)).
        s: active group size, in [1, E-1].
        num_experts: E >= 2.
        alpha_hi, alpha_lo: active and inactive bases, > 0.

    Returns:
        lambda > 0.
    """
    _check_mass_and_count(m, num_experts, "s", s)
    _check_positive("alpha_hi", alpha_hi)
    _check_positive("alpha_lo", alpha_lo)
    ok = is_finite_number(v_tar) and 0.0 < v_tar < m * (1.0 - m)
    require(ok, "v_tar", v_tar, f"in (0, m(1-m)) = (0, {m * (1.0 - m):g})")
    C = s * alpha_hi + (num_experts - s) * alpha_lo
    implied_m = s * alpha_hi / C
    if abs(implied_m - m) > 1e-3:
        raise ValueError(
            f"m={m!r} does not match the mean active mass {implied_m:.6g} implied by alpha_hi={alpha_hi!r}, "
            f"alpha_lo={alpha_lo!r}, s={s}, E={num_experts} (use alpha_hi = alpha_ratio(m, E, s) * alpha_lo)"
        )
    return (m * (1.0 - m) / v_tar - 1.0) / C


def dirichlet_kl(alpha_q: torch.Tensor, alpha_p: torch.Tensor) -> torch.Tensor:
    """Closed-form ``KL(Dir(alpha_q) || Dir(alpha_p))`` over the last dimension, differentiable in both:
    ``lgG(sum q) - sum lgG(q) - lgG(sum p) + sum lgG(p) + sum (q - p)(digamma(q) - digamma(sum q))``. Checks the
    values (a device sync on GPU; the router's hot path uses :func:`kl_terms`, unchecked).

    Args:
        alpha_q: ``[..., E]`` posterior concentrations, > 0.
        alpha_p: ``[..., E]`` prior concentrations, > 0 (broadcast against ``alpha_q``).

    Returns:
        ``[...]`` KL divergences, in the inputs' dtype.

    Raises:
        ValueError: non-broadcasting shapes, an empty last dimension, or invalid values.
    """
    try:
        shape = torch.broadcast_shapes(alpha_q.shape, alpha_p.shape)
    except RuntimeError as err:
        raise ValueError(f"alpha_q {tuple(alpha_q.shape)} and alpha_p {tuple(alpha_p.shape)} do not broadcast") from err
    if len(shape) == 0 or shape[-1] < 1:
        raise ValueError(f"concentrations need a non-empty last (expert) dimension, got shape {tuple(shape)}")
    for name, alpha in (("alpha_q", alpha_q), ("alpha_p", alpha_p)):
        if not bool(torch.isfinite(alpha).all()) or not bool((alpha > 0).all()):
            raise ValueError(f"{name} must be positive and finite")
    alpha_q, alpha_p = torch.broadcast_tensors(alpha_q, alpha_p)
    return kl_terms(alpha_q, alpha_p, alpha_q.sum(-1, keepdim=True))[0].sum(-1)


def kl_terms(alpha_q: torch.Tensor, alpha_p: torch.Tensor, q0: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`dirichlet_kl`'s terms, unchecked (``KL = F.sum(-1)``), plus what its closed-form gradient reuses:
    ``F = lgG(X) - lgG(Y) + (Y - X) digamma(C)`` over ``E + 1`` columns, ``X = [p, q0]``, ``Y = [q, p0]``,
    ``C = [q, q0]`` (``q0``, ``p0`` the totals): one lgamma per argument, one digamma, no per-column sign.

    Args:
        alpha_q: ``[..., E]`` posterior concentrations (q), > 0.
        alpha_p: ``[..., E]`` prior concentrations (p), same shape, > 0.
        q0: ``[..., 1]`` ``alpha_q.sum(-1, keepdim=True)``.

    Returns:
        ``(F, C, Y - X)``, each ``[..., E + 1]``.
    """
    X = torch.cat([alpha_p, q0], -1)
    Y = torch.cat([alpha_q, alpha_p.sum(-1, keepdim=True)], -1)
    C = torch.cat([alpha_q, q0], -1)
    delta = Y - X
    return torch.addcmul(torch.lgamma(X) - torch.lgamma(Y), delta, torch.digamma(C)), C, delta


def dirichlet_expected_simpson(alpha: torch.Tensor) -> torch.Tensor:
    """The Lemma per row: ``E[sum_i p_i^2] = sum_i alpha_i (alpha_i + 1) / (alpha_0 (alpha_0 + 1))`` for
    ``p ~ Dir(alpha)``, ``alpha_0 = sum_i alpha_i``.

    Args:
        alpha: ``[..., E]`` concentrations, > 0 (unchecked: the router's hot path).

    Returns:
        ``[...]`` expected Simpson indices, in alpha's dtype.
    """
    a0 = alpha.sum(-1)
    return (alpha * (alpha + 1.0)).sum(-1) / (a0 * (a0 + 1.0))


def reconstruction_loss(
    target_TD: torch.Tensor, recon_TD: torch.Tensor, *, sigma2: float = 1.0, reduction: str = "mean",
    target: str = "raw",
) -> torch.Tensor:
    """The Gaussian decoder's NLL up to a constant, ``mean_t ||y_t - recon_t||^2 / (2 sigma^2)``, ``y_t = x_t``
    (``"raw"``, the paper) or ``x_t - mean_s x_s`` (``"centered"``, gap 9); ``reduction="mean"`` divides by D
    (the paper's decoder with sigma^2 D, gap 5).

    Args:
        target_TD: ``[T, D]`` target x (detach it to treat it as data).
        recon_TD: ``[T, D]`` decoder output.
        sigma2: decoder variance sigma^2 > 0.
        reduction: ``"mean"`` or ``"sum"`` over D.
        target: ``"raw"`` or ``"centered"``.

    Returns:
        A scalar, differentiable in both tensors.
    """
    require(reduction in RECON_REDUCTIONS, "reduction", reduction, f"one of {', '.join(map(repr, RECON_REDUCTIONS))}")
    require(target in ("raw", "centered"), "target", target, "'raw' or 'centered'")
    if target_TD.shape != recon_TD.shape or target_TD.dim() != 2:
        raise ValueError(f"target {tuple(target_TD.shape)} and recon {tuple(recon_TD.shape)} must both be [T, D]")
    if target == "centered":
        target_TD = target_TD - target_TD.mean(0, keepdim=True)
    if reduction == "mean":
        # Mean over D then tokens = mean over all entries: one fused op (one backward) instead of three (~ten).
        return torch.nn.functional.mse_loss(recon_TD, target_TD) / (2.0 * sigma2)
    return (target_TD - recon_TD).pow(2).sum(-1).mean() / (2.0 * sigma2)
