"""Routing analysis of trained models: expert specialisation by domain and DirMoE's sparsity knob."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from routers.base import Router, RouterOutput


@dataclass
class RouterTrace:
    """Per layer, the routers' inputs (``hidden_TD``, float32) and outputs, detached on the CPU."""

    inputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, list[RouterOutput]] = field(default_factory=dict)


@contextlib.contextmanager
def trace_routers(model: nn.Module, keep_inputs: bool = False) -> Iterator[RouterTrace]:
    """Record ``model``'s router calls in the block into the yielded :class:`RouterTrace` (with inputs if asked)."""
    trace = RouterTrace()
    handles = []
    for layer, router in enumerate(m for m in model.modules() if isinstance(m, Router)):

        def hook(_module, args, output, layer=layer):
            detached = RouterOutput(probs=output.probs.detach().float().cpu(),
                                    routing_map=output.routing_map.detach().cpu())
            trace.outputs.setdefault(layer, []).append(detached)
            if keep_inputs:
                trace.inputs.setdefault(layer, []).append(args[0].detach().float().cpu())

        handles.append(router.register_forward_hook(hook))
    try:
        yield trace
    finally:
        for h in handles:
            h.remove()


def expert_specialisation(
    forward: Callable[[torch.Tensor], object], model: nn.Module, documents: Iterable[tuple[list[int], str]],
    seq_length: int, max_tokens_per_domain: int = 8192,
) -> dict[str, object]:
    """Share of each domain's tokens routed to each expert, per layer (the paper's specialisation figure).

    Windows run one at a time (batch-coupled routers see no other domain); a token counts once per expert
    receiving it (Lory: by combine weights). Expert Choice's shares are uniform by construction.

    Args:
        forward, model: runs the model on ``[1, S]`` ids (eval mode, no gradients); the model whose routers are traced.
        documents: ``(token_ids, domain)`` pairs.
        seq_length, max_tokens_per_domain: window length; tokens read per domain at most.

    Returns:
        ``{"domains": [...], "num_experts": E, "tokens": {domain: n}, "share": [[[float]*E]*domains]*L}``.
    """
    counts: dict[str, torch.Tensor] = {}
    seen: dict[str, int] = {}
    for ids, domain in documents:
        for start in range(0, len(ids), seq_length):
            if seen.get(domain, 0) >= max_tokens_per_domain:
                break
            window = ids[start : start + seq_length]
            if len(window) < 2:
                continue
            with trace_routers(model) as trace, torch.no_grad():
                forward(torch.tensor([window], dtype=torch.long))
            # [E] tokens routed per expert and layer (combine weights if every token goes everywhere, as in Lory)
            outputs = [trace.outputs[layer][0] for layer in sorted(trace.outputs)]
            per_layer = torch.stack([o.probs.sum(0) if o.routing_map.all() else o.routing_map.float().sum(0)
                                     for o in outputs])
            counts[domain] = counts.get(domain, 0) + per_layer
            seen[domain] = seen.get(domain, 0) + len(window)
    domains = sorted(counts)
    if not domains:
        return {"domains": [], "num_experts": 0, "tokens": {}, "share": []}
    stacked_LXE = torch.stack([counts[d] for d in domains], dim=1)  # X = domains
    share_LXE = stacked_LXE / stacked_LXE.sum(-1, keepdim=True).clamp_min(1)
    return {"domains": domains, "num_experts": int(share_LXE.shape[-1]), "tokens": {d: seen[d] for d in domains},
            "share": share_LXE.tolist()}


def has_sparsity_knob(router: Router) -> bool:
    """Whether a router has a Dirichlet posterior whose scale is a sparsity knob (``posterior_bases``)."""
    return callable(getattr(router, "posterior_bases", None))


def sparsity_knob(
    router: Router, hidden_TD: torch.Tensor, lambdas: Iterable[float], samples: int = 64, seed: int = 0
) -> dict[str, list[float]]:
    """Expected Simpson index of theta ~ ``Dir(lambda * beta(x))`` (DirMoE) against lambda: by the paper's Lemma,
    ``(lambda S2/B + 1) / (lambda B + 1)`` (B = sum beta, S2 = sum beta^2, token mean), and by Monte Carlo.

    Args:
        router: has ``posterior_bases(hidden_TD)`` and ``posterior_scale`` (:func:`has_sparsity_knob`).
        hidden_TD: router inputs (e.g. from :func:`trace_routers`).
        lambdas: the scales to sweep.
        samples, seed: Dirichlet draws per token and lambda; their seed.

    Returns:
        ``{"lambda": [...], "theory": [...], "measured": [...], "trained_lambda": [the router's scale]}``.
    """
    base_TE = router.posterior_bases(hidden_TD)
    B_T = base_TE.sum(-1)
    S2_T = (base_TE * base_TE).sum(-1)
    out: dict[str, list[float]] = {"lambda": [], "theory": [], "measured": []}
    # Seeded draws without disturbing the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for lam in lambdas:
            theory_T = (lam * S2_T / B_T + 1) / (lam * B_T + 1)
            posterior = torch.distributions.Dirichlet((lam * base_TE).double(), validate_args=False)
            theta_NTE = posterior.sample((samples,))
            out["lambda"].append(float(lam))
            out["theory"].append(float(theory_T.mean()))
            out["measured"].append(float((theta_NTE * theta_NTE).sum(-1).nanmean()))
    out["trained_lambda"] = [router.posterior_scale]
    return out
