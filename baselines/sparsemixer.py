"""SparseMixer-v2: sampled top-1/top-2 routing with a midpoint-corrected gradient estimator.

References:
    Liu et al., "GRIN: GRadient-INformed MoE", 2024 (arXiv:2409.12136), introducing SparseMixer-v2 (after
    arXiv:2310.00811). Code: microsoft/SparseMixer ``sparsemixer/sparsemixer_v2.py`` (``sparsemixerv2_routing``,
    autograd function ``v2core``).

``reference`` (:data:`REFERENCE_SETTINGS`): ``"grin"`` (GRIN's Phi-3.5-MoE config and model code) is the default:
the comparisons reproduced (ReMoE Table 2, copied by DirMoE) cite GRIN and set none of its hyper-parameters, so its
LM-pretraining setting applies; ``"sparsemixer-repo"`` (the repository's defaults: jitter 0.1) serves fairseq
translation. Balancing loss: megatron-core's ``alpha * E * sum_i f_i P_i`` as Switch; GRIN's code divides ``f`` by
T, not ``k T`` (twice the loss at k = 2; not switchable).

Pooled loss: GRIN computes one loss, weighted once by alpha, on all L layers' logits (``[L T, E]``); megatron
adds one per layer. ``alpha E sum_e fbar_e Pbar_e`` (layer means of ``f_l``, ``P_l``) is bilinear, *not* a sum
over layers: its gradient for layer m, ``(alpha E / L) sum_e fbar_e dP_me``, needs every layer's counts. So one
model's routers share a :class:`BalancePool` (:meth:`SparseMixerRouter.link_layers`) into which each training
forward adds its scores (with graph) and counts; the last layer returns the pooled switch loss as its
``load_balancing_loss``, exact in value and gradient. Unsupported with activation recomputation or pipeline
stages (a layer must enter the pool once per forward); the suite uses neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

from baselines._gate import GatedRouter, balance_metric
from routers import RouterConfig, RouterOutput, RoutingConstraint, RoutingKind, register_router
from routers.base import require

#: Heun's third-order rule f(x) - f(0) = 1/4 f'(x) + 3/4 f'(x/3): a sampled non-arg-max expert keeps its full
#: weight with probability 1/4, a third of it otherwise.
HEUN_FULL_PROBABILITY = 0.25
HEUN_MIDPOINT_SCALE = 1.0 / 3.0

REFERENCE_SETTINGS: dict[str, dict[str, float | str]] = {
    "grin": {"jitter_eps": 0.01, "aux_loss_coeff": 1e-3, "balance_map": "topk", "balance_scope": "pooled"},
    "sparsemixer-repo": {"jitter_eps": 0.1, "aux_loss_coeff": 1e-2, "balance_map": "sampled",
                         "balance_scope": "per-layer"},
}
BALANCE_MAPS = ("topk", "sampled")
BALANCE_SCOPES = ("pooled", "per-layer")


@dataclass(frozen=True)
class SparseMixerConfig(RouterConfig):
    """Options of the SparseMixer-v2 router (``top_k`` must be 1 or 2, the cases the reference supports)."""

    reference: str = "grin"  # "grin" | "sparsemixer-repo": preset for the options left at None
    # jitter mask: expert i is excluded when (max_j l_j - l_i) / max(|l_i|, max_j l_j) > 2 * eps
    jitter_eps: float | None = None
    aux_loss_coeff: float | None = None  # alpha of the switch load-balancing loss; 0 turns it off
    balance_map: str | None = None  # f_i counts "topk" (k largest of the plain softmax) or "sampled" experts
    balance_scope: str | None = None  # "pooled" (one loss over all layers' logits) or "per-layer"
    init_std: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.top_k in (1, 2), "top_k", self.top_k, "1 or 2 for sparsemixer (the reference's cases)")
        references = tuple(REFERENCE_SETTINGS)
        require(self.reference in references, "reference", self.reference, f"one of {references}")
        eps, alpha = self.jitter_eps, self.aux_loss_coeff
        require(eps is None or eps >= 0, "jitter_eps", eps, ">= 0")
        require(alpha is None or alpha >= 0, "aux_loss_coeff", alpha, ">= 0")
        for name, choices in (("balance_map", BALANCE_MAPS), ("balance_scope", BALANCE_SCOPES)):
            value = getattr(self, name)
            require(value is None or value in choices, name, value, f"one of {choices}")
        require(self.init_std > 0, "init_std", self.init_std, "> 0")

    def _preset(self, name: str) -> float | str:
        """The option ``name``, or the ``reference`` preset's when it is None."""
        value = getattr(self, name)
        return REFERENCE_SETTINGS[self.reference][name] if value is None else value

    effective_jitter_eps = property(lambda self: float(self._preset("jitter_eps")))
    effective_aux_loss_coeff = property(lambda self: float(self._preset("aux_loss_coeff")))
    effective_balance_map = property(lambda self: self._preset("balance_map"))
    effective_balance_scope = property(lambda self: self._preset("balance_scope"))


class BalancePool:
    """The L layers' softmax scores and counts of one training forward, pooled into one loss (a layer finding its
    entry already there, after a forward that stopped midway, restarts it)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._entries: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(
        self, layer: int | None, scores_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Add one layer's entry; once all L are in, return ``(scores [L T, E], counts [E])`` in layer order."""
        if layer in self._entries:
            self._entries.clear()
        self._entries[layer] = (scores_TE, tokens_per_expert_E)
        if len(self._entries) < self.num_layers:
            return None
        entries = [self._entries[key] for key in sorted(self._entries, key=lambda k: -1 if k is None else k)]
        self._entries.clear()
        return torch.cat([e[0] for e in entries]), torch.stack([e[1] for e in entries]).sum(0)


class SparseMixerV2Estimator(torch.autograd.Function):
    """Forward: ``pi_i * scale``. Backward: SparseMixer-v2's estimate ``g * pi_i * (e_i - pi)``, d(pi_i)/d(logits)
    without ``scale`` (as ``v2core``): an *estimator*, so gradcheck does not apply."""

    @staticmethod
    def forward(ctx, logits_TE, pi_TE, selected_T, scale_T):  # type: ignore[override]
        pi_selected_T = pi_TE.gather(1, selected_T[:, None]).squeeze(1)
        ctx.save_for_backward(pi_TE, selected_T, pi_selected_T)
        return pi_selected_T * scale_T

    @staticmethod
    def backward(ctx, grad_T):  # type: ignore[override]
        pi_TE, selected_T, pi_selected_T = ctx.saved_tensors
        g_T1 = (grad_T * pi_selected_T)[:, None]
        grad_logits_TE = -pi_TE * g_T1
        grad_logits_TE.scatter_add_(1, selected_T[:, None], g_T1)
        return grad_logits_TE, None, None, None


def sparsemixer_v2_select(
    logits_TE: torch.Tensor, jitter_eps: float, training: bool, exclude_TE: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SparseMixer-v2 selection from ``[T, E]`` float32 logits (the second when ``exclude_TE`` masks the
    first): Gumbel-max sampling and Heun mixing in ``training``, else the arg-max.

    Returns:
        ``weight_T`` (differentiable through :class:`SparseMixerV2Estimator`), ``selected_T`` (long),
        ``pi_TE`` (softmax of the masked logits, detached) and ``scale_T`` (1 or 1/3).
    """
    with torch.no_grad():
        logits = logits_TE.detach()
        candidates_TE = logits if exclude_TE is None else logits.masked_fill(exclude_TE, float("-inf"))
        top_T1, top_index_T1 = candidates_TE.max(dim=-1, keepdim=True)
        # Relative gap to the best candidate, |l_i| floored at the best logit, on unmasked logits (as the reference).
        factor_TE = logits.abs().clamp(min=top_T1)
        masked_TE = (top_T1 - logits) / factor_TE > 2 * jitter_eps
        if exclude_TE is not None:
            masked_TE = masked_TE | exclude_TE
        masked_logits_TE = logits.masked_fill(masked_TE, float("-inf"))
        if training:
            # Gumbel-max sampling from softmax(masked logits): -log(Exp(1)) is a Gumbel(0, 1) draw.
            gumbel_TE = -torch.empty_like(masked_logits_TE).exponential_().log()
            selected_T = (masked_logits_TE + gumbel_TE).argmax(dim=-1)
        else:
            selected_T = top_index_T1.squeeze(-1)
        pi_TE = torch.softmax(masked_logits_TE, dim=-1)
        full_T = selected_T == pi_TE.argmax(dim=-1)
        if training:
            full_T = full_T | (torch.rand(full_T.shape, device=logits.device) < HEUN_FULL_PROBABILITY)
        scale_T = torch.where(full_T, 1.0, HEUN_MIDPOINT_SCALE).to(logits.dtype)
    weight_T = SparseMixerV2Estimator.apply(logits_TE, pi_TE, selected_T, scale_T)
    return weight_T, selected_T, pi_TE, scale_T


@register_router("sparsemixer")
class SparseMixerRouter(GatedRouter):
    """SparseMixer-v2 (GRIN, Liu et al. 2024), top-1 or top-2. Per selection (:func:`sparsemixer_v2_select`; the
    second masks out the first): weight ``pi_i`` times the Heun factor (1 for the arg-max of pi, else 1 w.p. 1/4
    and 1/3 w.p. 3/4, training only; the reference writes 1/3 as 0.3333); backward ``dL/dlogits = g * pi_i *
    (e_i - pi)``, summed over the k selections. Aux loss: ``load_balancing_loss`` (module docstring). Metrics:
    ``sampled_not_argmax``, ``mean_scale`` (mean Heun factor), ``balance_loss`` (unscaled).
    """

    Config = SparseMixerConfig

    def __init__(self, config: SparseMixerConfig) -> None:
        super().__init__(config)
        self._layer_number: int | None = None
        self._pool: BalancePool | None = None  # a plain attribute: per-forward state, not in the state dict

    @classmethod
    def link_layers(cls, routers: list[SparseMixerRouter]) -> None:
        """Give one model's SparseMixer routers a shared :class:`BalancePool` (``repro.model.builder`` calls it)."""
        pool = BalancePool(len(routers))
        for router in routers:
            router._pool = pool

    def set_layer_number(self, layer_number: int) -> None:
        """Keep the layer number: the pool's key for this layer's entry."""
        self._layer_number = layer_number

    def balance_loss(self, scores_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor | None:
        """This layer's training balancing loss (alpha applied): per layer (or without a pool) the switch loss on
        its scores; pooled, None until the forward's last layer, which returns the loss over all layers."""
        cfg = self.config
        pooled = (scores_TE, tokens_per_expert_E)
        if cfg.effective_balance_scope == "pooled" and self._pool is not None:
            pooled = self._pool.add(self._layer_number, scores_TE, tokens_per_expert_E)
            if pooled is None:
                return None
        scores_NE, tokens_E = pooled
        return switch_load_balancing_loss_func(
            scores_NE, tokens_E, scores_NE.shape[0], cfg.top_k, cfg.num_experts, cfg.effective_aux_loss_coeff
        )

    @property
    def constraint(self) -> RoutingConstraint:
        return RoutingConstraint(RoutingKind.EXACT_K, self.top_k, self.top_k, top_k=self.top_k)

    def route(self, hidden_TD, token_ids_T=None, seq_shape=None) -> RouterOutput:
        cfg = self.config
        T = hidden_TD.shape[0]
        logits_TE = self.logits(hidden_TD)
        exclude_TE = None
        weights, experts, not_argmax, scales = [], [], [], []
        for _ in range(cfg.top_k):
            weight_T, selected_T, pi_TE, scale_T = sparsemixer_v2_select(
                logits_TE, cfg.effective_jitter_eps, self.training, exclude_TE
            )
            # Not F.one_hot: it checks the class range with .item() (a host sync).
            chosen_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter_(1, selected_T[:, None], True)
            exclude_TE = chosen_TE if exclude_TE is None else exclude_TE | chosen_TE
            weights.append(weight_T)
            experts.append(selected_T)
            if self.collect_metrics:
                not_argmax.append(selected_T != pi_TE.argmax(-1))
            scales.append(scale_T)
        experts_Tk = torch.stack(experts, dim=1)
        probs_TE = logits_TE.new_zeros(T, cfg.num_experts).scatter(1, experts_Tk, torch.stack(weights, dim=1))
        routing_map_TE = exclude_TE

        scores_TE = torch.softmax(logits_TE, dim=-1)
        if cfg.effective_balance_map == "sampled":
            tokens_per_expert_E = routing_map_TE.sum(0)
        else:  # the top-k of the plain softmax, whatever was sampled
            top_Tk = scores_TE.detach().topk(cfg.top_k, dim=-1).indices
            tokens_per_expert_E = torch.zeros_like(routing_map_TE).scatter_(1, top_Tk, True).sum(0)
        aux_losses: dict[str, torch.Tensor] = {}
        if self.training and torch.is_grad_enabled() and cfg.effective_aux_loss_coeff > 0:
            loss = self.balance_loss(scores_TE, tokens_per_expert_E)
            if loss is not None:
                aux_losses["load_balancing_loss"] = loss
        return self.output(probs_TE, routing_map_TE, aux_losses, lambda: {
            "sampled_not_argmax": torch.stack(not_argmax).float().mean(),
            "mean_scale": torch.stack(scales).mean(),
            "balance_loss": balance_metric(scores_TE, tokens_per_expert_E, cfg),
        })
