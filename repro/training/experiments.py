"""Named training experiments: one frozen dataclass per run configuration, and the registry of them.

An :class:`Experiment` says everything a training run needs except where it writes (``--out``) and how
many processes run it (``torchrun``). The registry holds:

* ``<router>-tiny`` for each of the seven routers and ``dense-tiny`` (plus ``megatron-tiny``, megatron-core's
  own ``TopKRouter``): the tiny flavour on CPU-sized batches, for tests and the embedded default;
* ``<router>-185m`` and ``dense-185m``: the papers' LLaMA-185M settings (ReMoE's training scripts; DirMoE's hyper-parameter table).

Settings of the 185M runs and where they come from:

* ReMoE's published launch script (thu-ml/ReMoE, ``train_llama_*_remoe.sh``): micro batch 16, global batch
  512 x 1024 tokens, 60k iterations, LR 5e-4 cosine to 5e-5, warmup fraction 0.01, clip 1.0, bf16,
  Megatron's default AdamW (betas (0.9, 0.999), eps 1e-8, weight decay 0.01), eval every 1000 iterations
  over 100 batches, checkpoint every 2500.
* DirMoE's hyper-parameter table: the same except min LR 1e-4 and betas (0.9, 0.995); applied to the
  DirMoE run only (the baselines keep ReMoE's settings, which is how both papers report them).

Overrides (``--set key=value``) are parsed with :func:`apply_overrides`; router options are set as
``router_options.NAME=VALUE`` and checked against the router's own config dataclass.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from repro.errors import ReproError

#: The seven routers of the comparison (the registry's ``<router>-tiny`` / ``<router>-185m`` names).
ROUTERS: tuple[str, ...] = ("dirmoe", "switch", "remoe", "expert_choice", "hash", "lory", "sparsemixer")
#: megatron-core's own TopKRouter, offered by the model builder under this name (reference for Switch).
MEGATRON_ROUTER = "megatron"
#: Accepted ``data`` values besides a ``pile:<path prefix>`` / ``indexed:<path prefix>`` spec.
DATA_CHOICES: tuple[str, ...] = ("synthetic", "mini-pile")
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class Experiment:
    """One training run's configuration.

    Args:
        name: the registry name (kept in ``config.json`` and the summary).
        router: a registered router name, ``"megatron"`` (megatron-core's TopKRouter) or ``None`` for a
            dense model.
        flavour: a model flavour name of :func:`repro.model.flavours.get_flavour`.
        router_options: ``(name, value)`` pairs passed to the router's config (sorted by name). A router
            option ``schedule_steps`` left unset is filled with ``steps`` (DirMoE's schedules span the run).
        micro_batch_size: sequences per forward pass on one data-parallel rank.
        global_batch_size: sequences per optimizer step over all ranks; must be a multiple of
            ``micro_batch_size * dp_size`` (the quotient is the gradient-accumulation count).
        seq_length: tokens per sequence; ``None`` takes the flavour's.
        steps: optimizer steps (iterations) of the whole run.
        lr: peak learning rate.
        min_lr: the floor the cosine decays to.
        warmup_fraction: linear warmup length as a fraction of ``steps`` (used when ``warmup_steps`` is None).
        warmup_steps: explicit warmup length in steps (overrides ``warmup_fraction``).
        weight_decay: AdamW decoupled weight decay (not applied to biases and 1-D parameters, as megatron).
        adam_beta1: AdamW beta1.
        adam_beta2: AdamW beta2.
        adam_eps: AdamW epsilon.
        clip_grad: global gradient-norm clip (0 disables).
        seed: seeds model init, router noise and the synthetic data.
        data: ``"synthetic"`` (seeded token source, no files), ``"mini-pile"`` / ``"mini-pile:<dir>"`` (the
            embedded corpus of :mod:`repro.data.minipile`, built on first use, default dir
            ``data/mini-pile``), or ``"pile:<prefix>"`` / ``"indexed:<prefix>"`` (megatron indexed dataset
            path prefixes, comma-separated for several).
        tokenizer: directory with the GPT-2 BPE ``vocab.json`` and ``merges.txt`` of indexed data (default:
            the first prefix's directory).
        vocab_size: vocabulary of the synthetic source (``None``: 512); real data takes the tokenizer's.
        synthetic_samples: distinct synthetic sequences before they repeat (0: never repeat).
        precision: ``"auto"`` (bf16 on GPU, fp32 on CPU), ``"fp32"`` or ``"bf16"`` (GPU only).
        tp: tensor-parallel size.
        ep: expert-parallel size (experts sharded over ``ep`` ranks, alltoall dispatcher).
        log_interval: steps between progress-bar updates (``log.jsonl`` has every step).
        eval_interval: steps between validation-loss evaluations (0: none).
        eval_iters: micro-batches per validation evaluation.
        checkpoint_interval: steps between checkpoints (0: only the final one).
        distributed_optimizer: GPU only: megatron's distributed optimizer (optimizer state sharded over DP
            ranks; its checkpoint path gathers the state to DP rank 0). Off by default: the plain megatron
            optimizer's checkpoint is the simpler, and with DP=1 the two are the same.
        init_from: a checkpoint directory whose model weights initialise the run (any DP/EP layout); the
            optimizer, data position and step start fresh.
        layout_independent_init: with ``ep > 1``, build the full model once under EP=1 and keep this rank's
            experts from it, so the initial weights equal a one-process run's (costs one extra build).
    """

    name: str
    router: str | None
    flavour: str
    router_options: tuple[tuple[str, Any], ...] = ()
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seq_length: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    steps: int = 100
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_fraction: float = 0.01
    warmup_steps: int | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    data: str = "synthetic"
    tokenizer: str = ""
    vocab_size: int | None = None
    synthetic_samples: int = 0
    precision: str = "auto"
    tp: int = 1
    ep: int = 1
    log_interval: int = 1
    eval_interval: int = 0
    eval_iters: int = 2
    checkpoint_interval: int = 0
    distributed_optimizer: bool = False
    init_from: str = ""
    layout_independent_init: bool = True

    def __post_init__(self) -> None:
        # Normalise router_options to sorted pairs so equal configs compare (and hash) equal.
        opts = self.router_options
        if isinstance(opts, Mapping):
            opts = tuple(opts.items())
        # JSON turns tuples into lists: back to tuples, so a config read from disk equals the original.
        opts = ((str(k), tuple(v) if isinstance(v, list) else v) for k, v in opts)
        object.__setattr__(self, "router_options", tuple(sorted(opts)))
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise :class:`ReproError` naming the first invalid field."""
        positive = ("micro_batch_size", "global_batch_size", "steps", "tp", "ep", "log_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ReproError(f"experiment '{self.name}': {name} must be >= 1, got {getattr(self, name)}")
        non_negative = ("eval_interval", "eval_iters", "checkpoint_interval", "synthetic_samples", "weight_decay",
                        "clip_grad", "min_lr", "adam_eps")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ReproError(f"experiment '{self.name}': {name} must be >= 0, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ReproError(
                f"experiment '{self.name}': global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size {self.micro_batch_size}"
            )
        if not 0 < self.lr:
            raise ReproError(f"experiment '{self.name}': lr must be > 0, got {self.lr}")
        if self.min_lr > self.lr:
            raise ReproError(f"experiment '{self.name}': min_lr {self.min_lr} is above lr {self.lr}")
        if not 0.0 <= self.warmup_fraction <= 1.0:
            raise ReproError(f"experiment '{self.name}': warmup_fraction must be in [0, 1], got {self.warmup_fraction}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ReproError(f"experiment '{self.name}': warmup_steps must be in [0, steps={self.steps}]")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ReproError(f"experiment '{self.name}': {name} must be in [0, 1), got {getattr(self, name)}")
        if self.precision not in PRECISIONS:
            raise ReproError(f"experiment '{self.name}': precision must be one of {', '.join(PRECISIONS)}")
        if not (self.data in DATA_CHOICES or self.data.partition(":")[0] in ("pile", "indexed", "mini-pile")):
            raise ReproError(
                f"experiment '{self.name}': data must be one of {', '.join(DATA_CHOICES)}, 'mini-pile:<dir>', "
                f"'pile:<prefix>' or 'indexed:<prefix>', got '{self.data}'"
            )
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ReproError(f"experiment '{self.name}': vocab_size must be >= 2")
        if self.seq_length is not None and self.seq_length < 2:
            raise ReproError(f"experiment '{self.name}': seq_length must be >= 2")
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if value is not None and (self.router is None or value < 1):
                raise ReproError(f"experiment '{self.name}': {name} needs a router and a value >= 1, got {value}")

    def model_flavour(self):
        """The model flavour with this experiment's overrides (``num_experts``, ``top_k``) applied.

        Raises:
            ValueError: an unknown flavour or an invalid override.
        """
        from repro.model.flavours import get_flavour

        overrides = {k: v for k, v in (("num_experts", self.num_experts), ("top_k", self.top_k)) if v is not None}
        return get_flavour(self.flavour, **overrides)

    # --------------------------------------------------------------- derived
    @property
    def is_moe(self) -> bool:
        """Whether the model has routed experts (``router`` is set)."""
        return self.router is not None

    @property
    def num_warmup_steps(self) -> int:
        """Warmup length in steps (``warmup_steps`` or ``round(warmup_fraction * steps)``)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(round(self.warmup_fraction * self.steps))

    def num_microbatches(self, dp_size: int) -> int:
        """Gradient-accumulation count for ``dp_size`` data-parallel ranks.

        Args:
            dp_size: data-parallel world size.

        Returns:
            ``global_batch_size / (micro_batch_size * dp_size)``.

        Raises:
            ReproError: the global batch does not divide evenly.
        """
        per_step = self.micro_batch_size * dp_size
        if self.global_batch_size % per_step:
            raise ReproError(
                f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size x "
                f"data-parallel size = {self.micro_batch_size} x {dp_size}"
            )
        return self.global_batch_size // per_step

    def build_router_options(self) -> dict[str, Any]:
        """The options handed to the model builder for the router.

        Fills ``schedule_steps`` with ``steps`` when the router has that option and it is unset, so
        step-dependent schedules (DirMoE's temperature and prior scale) span the whole run.

        Returns:
            ``{option: value}``.
        """
        options = dict(self.router_options)
        if self.router and self.router != MEGATRON_ROUTER and "schedule_steps" not in options:
            spec = _router_option_types(self.router)
            if spec is not None and "schedule_steps" in spec:
                options["schedule_steps"] = self.steps
        return options

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (router options as a mapping)."""
        d = dataclasses.asdict(self)
        d["router_options"] = {k: v for k, v in self.router_options}
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Experiment:
        """Rebuild an experiment from :meth:`to_dict`'s output.

        Args:
            data: the dict (e.g. read from ``config.json``).

        Returns:
            The experiment.

        Raises:
            ReproError: unknown fields.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ReproError(f"unknown experiment field(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        data = dict(data)
        data["router_options"] = tuple(dict(data.get("router_options") or {}).items())
        return cls(**data)


# ----------------------------------------------------------------------------------------- registry
def _tiny(router: str | None, **kw: Any) -> Experiment:
    # CPU-sized: a few hundred steps of the tiny flavour on the embedded mini-pile (the suite's CPU default,
    # the same pipeline as The Pile) take minutes on 2 cores. Tests switch to data=synthetic.
    base: dict[str, Any] = dict(
        name=f"{router or 'dense'}-tiny",
        router=router,
        flavour="tiny" if router else "tiny-dense",
        micro_batch_size=4,
        global_batch_size=8,
        steps=200,
        lr=2e-3,
        min_lr=2e-4,
        warmup_fraction=0.05,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.999,
        clip_grad=1.0,
        data="mini-pile",
        log_interval=10,
        eval_interval=50,
        eval_iters=2,
        checkpoint_interval=100,
    )
    base.update(kw)
    return Experiment(**base)


def _paper_185m(router: str | None, **kw: Any) -> Experiment:
    base: dict[str, Any] = dict(
        name=f"{router or 'dense'}-185m",
        router=router,
        flavour="llama-185m" if router else "llama-185m-dense",
        micro_batch_size=16,
        global_batch_size=512,
        seq_length=1024,
        steps=60_000,
        lr=5e-4,
        min_lr=5e-5,
        warmup_fraction=0.01,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        clip_grad=1.0,
        precision="bf16",
        data="pile:data/pile/pile_text_document",
        log_interval=10,
        eval_interval=1000,
        eval_iters=100,
        checkpoint_interval=2500,
    )
    base.update(kw)
    return Experiment(**base)


def _build_registry() -> Mapping[str, Experiment]:
    experiments: list[Experiment] = []
    for router in ROUTERS:
        if router == "lory":
            # Lory's 256-token segments would leave the tiny flavour's 128-token sequences one segment each
            # (routed on itself): 32 keeps several segments per sequence, so the cross-segment routing runs.
            experiments.append(_tiny(router, router_options=(("segment_len", 32),)))
        else:
            experiments.append(_tiny(router))
    experiments.append(_tiny(None))
    experiments.append(_tiny(MEGATRON_ROUTER))
    for router in ROUTERS:
        if router == "dirmoe":
            # DirMoE's hyper-parameter table: cosine floor 1e-4 and beta2 0.995.
            experiments.append(_paper_185m(router, min_lr=1e-4, adam_beta2=0.995))
        else:
            experiments.append(_paper_185m(router))
    experiments.append(_paper_185m(None))
    experiments.append(_paper_185m(MEGATRON_ROUTER))
    return types.MappingProxyType({e.name: e for e in experiments})


#: name -> experiment (read-only).
EXPERIMENTS: Mapping[str, Experiment] = _build_registry()


def experiment_names() -> list[str]:
    """All registered experiment names, sorted."""
    return sorted(EXPERIMENTS)


def get_experiment(name: str) -> Experiment:
    """The registered experiment called ``name``.

    Args:
        name: a name from :func:`experiment_names`.

    Returns:
        The experiment.

    Raises:
        ReproError: unknown name (the message lists the valid ones).
    """
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise ReproError(f"unknown experiment '{name}'; valid: {', '.join(experiment_names())}") from None


# ---------------------------------------------------------------------------------------- overrides
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null"}


def _parse_scalar(text: str, typ: Any, what: str) -> Any:
    """Parse ``text`` as a value of type annotation ``typ`` (int, float, bool, str, X | None, tuple)."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if type(None) in args and text.strip().lower() in _NONE:
            return None
        errors = []
        for a in inner:
            try:
                return _parse_scalar(text, a, what)
            except ReproError as exc:
                errors.append(str(exc))
        raise ReproError(errors[0] if errors else f"{what}: cannot parse '{text}'")
    if origin is tuple:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_parse_scalar(p, args[0], what) for p in parts)
        if args and len(args) != len(parts):
            raise ReproError(f"{what}: expected {len(args)} comma-separated values, got '{text}'")
        return tuple(_parse_scalar(p, a, what) for p, a in zip(parts, args or (Any,) * len(parts)))
    if typ is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ReproError(f"{what}: expected a boolean (true/false), got '{text}'")
    if typ is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:
                as_float = float(text)
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
            raise ReproError(f"{what}: expected an integer, got '{text}'") from None
    if typ is float:
        try:
            return float(text)
        except ValueError:
            raise ReproError(f"{what}: expected a number, got '{text}'") from None
    if typ is str:
        return text
    if typ is Any or typ is object:
        return _parse_literal(text)
    raise ReproError(f"{what}: cannot parse values of type {typ!r}")


def _parse_literal(text: str) -> Any:
    """Best-effort literal for options whose type is unknown: JSON (numbers, booleans, null), else string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return json.loads(text)
    except ValueError:
        return text


def _router_option_types(router: str) -> dict[str, Any] | None:
    """``{option: type annotation}`` of a registered router's config, or None if the router is unknown."""
    try:
        from routers.registry import router_class

        cls = router_class(router)
    except (ValueError, ImportError):
        return None
    hints = typing.get_type_hints(cls.Config)
    return {name: hints.get(name, Any) for name in cls.Config.option_names()}


def _megatron_option_types() -> dict[str, Any]:
    """Options of megatron-core's own TopKRouter (the ``megatron`` router), each an optional float."""
    from repro.model.builder import _MEGATRON_ROUTER_OPTIONS

    return {name: float | None for name in _MEGATRON_ROUTER_OPTIONS}


_EXPERIMENT_FIELDS = {f.name: f for f in dataclasses.fields(Experiment)}


def apply_overrides(experiment: Experiment, assignments: Iterable[str]) -> Experiment:
    """Apply ``key=value`` overrides (the ``--set`` options) to an experiment.

    Keys are :class:`Experiment` field names, values parsed to the field's type (``none`` for optional
    fields). Router options are ``router_options.NAME=VALUE``, parsed with the type of the router's config
    field ``NAME`` (so ``router_options.sparsity_weight=0.1`` sets a float); ``router_options=`` (empty)
    clears them. Plain fields are applied first, so ``router=remoe router_options.l1_coeff_multiplier=1.1`` checks the
    option against ReMoE whatever the order; changing ``router`` drops the previous router's options.

    Args:
        experiment: the starting experiment.
        assignments: ``"key=value"`` strings.

    Returns:
        The new experiment (validated).

    Raises:
        ReproError: malformed assignment, unknown key (the message lists the valid keys), bad value.
    """
    pairs: list[tuple[str, str]] = []
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ReproError(f"--set expects key=value, got '{item}'")
        pairs.append((key.strip(), value))

    hints = typing.get_type_hints(Experiment)
    changes: dict[str, Any] = {}
    clear_options = False
    for key, value in pairs:
        if key.startswith("router_options."):
            continue
        if key == "router_options":
            if value.strip():
                raise ReproError("--set router_options= only clears the options; set each as router_options.NAME=VALUE")
            clear_options = True
            continue
        if key not in _EXPERIMENT_FIELDS or key == "name":
            valid = sorted(n for n in _EXPERIMENT_FIELDS if n != "name") + ["router_options.<option>"]
            raise ReproError(f"unknown key '{key}'; valid: {', '.join(valid)}")
        changes[key] = _parse_scalar(value, hints[key], f"--set {key}")

    router = changes.get("router", experiment.router)
    if "router" in changes and router != experiment.router:
        clear_options = True  # another router's options would not fit the new one
        if router is not None and router != MEGATRON_ROUTER and router not in ROUTERS:
            known = _router_option_types(router)
            if known is None:
                raise ReproError(
                    f"--set router: unknown router '{router}'; valid: {', '.join(ROUTERS + (MEGATRON_ROUTER,))}, none"
                )
    options = {} if clear_options else dict(experiment.router_options)

    for key, value in pairs:
        if not key.startswith("router_options."):
            continue
        opt = key[len("router_options."):]
        if router is None:
            raise ReproError(f"--set {key}: the experiment has no router (router=none)")
        spec = _router_option_types(router) if router != MEGATRON_ROUTER else _megatron_option_types()
        if spec is None:
            # Router not importable here: keep a literal; the router's config validates it at build time.
            options[opt] = _parse_literal(value)
            continue
        if opt not in spec:
            raise ReproError(
                f"unknown option '{opt}' for router '{router}'; valid: {', '.join(sorted(spec)) or '(none)'}"
            )
        options[opt] = _parse_scalar(value, spec[opt], f"--set {key}")

    updated = dataclasses.replace(experiment, router_options=tuple(options.items()), **changes)
    _check_router_options(updated)
    return updated


def _check_router_options(experiment: Experiment) -> None:
    """Build the router's config dataclass from the options, so a bad value fails now, not at build time."""
    router = experiment.router
    if router is None or router == MEGATRON_ROUTER or not experiment.router_options:
        return
    try:
        from routers.registry import router_class

        cls = router_class(router)
    except (ValueError, ImportError):
        return
    try:
        flavour = experiment.model_flavour()
        hidden, experts, top_k = flavour.hidden_size, flavour.num_experts or 8, flavour.top_k
    except (ImportError, ValueError):
        hidden, experts, top_k = 8, 8, 1
    try:
        cls.Config(hidden_size=hidden, num_experts=experts, top_k=top_k, **dict(experiment.build_router_options()))
    except (ValueError, TypeError) as exc:
        raise ReproError(f"router '{router}' options {dict(experiment.router_options)}: {exc}") from None


def describe(experiment: Experiment) -> str:
    """One line describing an experiment for ``--list``."""
    router = experiment.router or "dense"
    return (
        f"{experiment.name:<22} router={router:<14} flavour={experiment.flavour:<17} steps={experiment.steps:<6} "
        f"batch={experiment.global_batch_size}x{experiment.seq_length or 'flavour'} lr={experiment.lr:g}->{experiment.min_lr:g}"
    )


__all__ = [
    "EXPERIMENTS",
    "Experiment",
    "MEGATRON_ROUTER",
    "ROUTERS",
    "apply_overrides",
    "describe",
    "experiment_names",
    "get_experiment",
]
