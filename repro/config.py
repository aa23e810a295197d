"""The run configuration: frozen dataclass sections (validated in ``__post_init__``) composed into one
:class:`RunConfig` (docs/experiments.md, "Experiments"). Overrides are dot-lists merged by OmegaConf structured
configs (:func:`apply_overrides`); OmegaConf rather than tyro: the suite merges data (experiment, recipe,
``--set``) and round-trips ``config.json``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from repro.errors import ReproError
from repro.flavours import MEGATRON_ROUTER, MEGATRON_ROUTER_OPTIONS
from repro.schema import check_minimums, flatten

#: Data sources besides ``pile:<prefix>`` / ``indexed:<prefix>`` / ``mini-pile:<dir>``.
DATA_CHOICES: tuple[str, ...] = ("synthetic", "mini-pile")

Precision = Literal["auto", "fp32", "bf16"]
Backend = Literal["auto", "te", "torch", "local"]
#: How the output layer and the loss are computed when labels are given (repro.model.fused_loss).
FusedCrossEntropy = Literal["none", "cce", "cce_filtered", "torch_compile"]


@dataclass(frozen=True)
class ModelConfig:
    """A flavour (``repro.flavours``) and its overridable fields (``num_experts``/``top_k``: MoE only).
    ``precision`` ``auto``: bf16 on GPU, fp32 on CPU; ``backend``/``backend_options``: docs/efficiency.md;
    ``fused_cross_entropy``: output layer and loss in one op, no fp32 logits (:mod:`repro.model.fused_loss`;
    ``none``: megatron's path)."""

    flavour: str = "tiny"
    num_experts: int | None = None
    top_k: int | None = None
    seq_length: int | None = None
    precision: Precision = "auto"
    backend: Backend = "auto"
    backend_options: dict[str, Any] = field(default_factory=dict)
    fused_cross_entropy: FusedCrossEntropy = "none"

    def __post_init__(self) -> None:
        check_minimums(self, "model", num_experts=1, top_k=1, seq_length=2)
        choices = typing.get_args(FusedCrossEntropy)
        if self.fused_cross_entropy not in choices:
            raise ValueError(f"model.fused_cross_entropy must be one of {', '.join(choices)}, "
                             f"got '{self.fused_cross_entropy}'")

    def flavour_config(self):
        """The :class:`repro.flavours.ModelFlavour` with these overrides (ValueError if it cannot take them)."""
        from repro.flavours import get_flavour

        overrides = {k: getattr(self, k) for k in ("num_experts", "top_k") if getattr(self, k) is not None}
        if overrides and get_flavour(self.flavour).num_experts is None:
            raise ValueError(f"model.{next(iter(overrides))} needs an MoE flavour, '{self.flavour}' is dense")
        return get_flavour(self.flavour, **overrides)


@dataclass(frozen=True)
class RouterSpec:
    """The router of every MoE layer: a registered ``name``, ``"megatron"`` (TopKRouter) or None (dense);
    ``options``: its config fields (``schedule_steps``, ``vocab_size`` default to the run's steps and vocabulary)."""

    name: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (torch's on CPU, megatron's on GPU) and gradient clipping.

    Args:
        weight_decay: decoupled, not on biases and 1-D parameters (as megatron).
        clip_grad: global gradient-norm clip (0 disables).
        distributed: GPU only: megatron's distributed optimizer (state sharded over data-parallel ranks).
        foreach_fallbacks: GPU only: ``torch._foreach_*`` for megatron's per-tensor-sync TE-free fallbacks
            (:func:`repro.training.optim.foreach_optimizer_fallbacks`); off: its fp32 reduction order would
            break bit-exact reruns.
    """

    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_grad: float = 1.0
    distributed: bool = False
    foreach_fallbacks: bool = False

    def __post_init__(self) -> None:
        check_minimums(self, "optimizer", weight_decay=0.0, eps=0.0, clip_grad=0.0, lr=-math.inf)  # lr: finite
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:  # also refuses NaN
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {value}")


@dataclass(frozen=True)
class ScheduleConfig:
    """Optimizer ``steps``; linear warmup over ``warmup_steps`` (None: ``warmup_fraction`` of ``steps``), then
    cosine decay to ``min_lr`` (<= ``optimizer.lr``)."""

    steps: int = 100
    warmup_fraction: float = 0.01
    warmup_steps: int | None = None
    min_lr: float = 1e-4

    def __post_init__(self) -> None:
        check_minimums(self, "schedule", steps=1, min_lr=0.0)
        if not 0.0 <= self.warmup_fraction <= 1.0:
            raise ValueError(f"schedule.warmup_fraction must be in [0, 1], got {self.warmup_fraction}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"schedule.warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}")

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else int(round(self.warmup_fraction * self.steps))


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how many a step takes.

    Args:
        source: ``synthetic`` (seeded), ``mini-pile[:<dir>]`` (embedded corpus, built on first use), or
            comma-separated megatron indexed prefixes ``pile:<prefix>`` / ``indexed:<prefix>``.
        tokenizer: directory with GPT-2 BPE ``vocab.json`` and ``merges.txt`` (default: the first prefix's).
        vocab_size, synthetic_samples: synthetic vocabulary (None: 512; real data: the tokenizer's); distinct
            synthetic sequences before they repeat (0: never).
        micro_batch_size / global_batch_size: sequences per forward pass per rank / per optimizer step, all ranks.
        similarity_batching: chains of similar documents (Lory, :mod:`repro.data.similarity`); indexed data only.
    """

    source: str = "synthetic"
    tokenizer: str = ""
    vocab_size: int | None = None
    synthetic_samples: int = 0
    micro_batch_size: int = 4
    global_batch_size: int = 8
    similarity_batching: bool = False

    def __post_init__(self) -> None:
        kind = self.source.partition(":")[0]
        if not (self.source in DATA_CHOICES or kind in ("pile", "indexed", "mini-pile")):
            raise ValueError(f"data.source must be one of {', '.join(DATA_CHOICES)}, 'mini-pile:<dir>', "
                             f"'pile:<prefix>' or 'indexed:<prefix>', got '{self.source}'")
        check_minimums(self, "data", vocab_size=2, synthetic_samples=0, micro_batch_size=1, global_batch_size=1)
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"data.global_batch_size {self.global_batch_size} is not a multiple of "
                             f"data.micro_batch_size {self.micro_batch_size}")

    def num_microbatches(self, dp_size: int) -> int:
        """Gradient-accumulation steps for ``dp_size`` ranks (ReproError if not whole)."""
        per_step = self.micro_batch_size * dp_size
        if self.global_batch_size % per_step:
            raise ReproError(f"data.global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size x "
                             f"data-parallel size = {self.micro_batch_size} x {dp_size}")
        return self.global_batch_size // per_step


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor- and expert-parallel sizes (``torchrun`` adds data parallelism)."""

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        check_minimums(self, "parallel", tp=1, ep=1)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints and initialisation.

    Args:
        interval: steps between checkpoints (0: only the final one).
        init_from: checkpoint whose model weights start the run (any DP/EP layout); optimizer, data and step fresh.
        init_router_step: with ``init_from``, router step schedules continue from its step (LR schedule restarts).
        layout_independent_init: with EP > 1, initial weights equal a one-process run's (built under EP=1).
    """

    interval: int = 0
    init_from: str = ""
    init_router_step: bool = False
    layout_independent_init: bool = True

    def __post_init__(self) -> None:
        check_minimums(self, "checkpoint", interval=0)


@dataclass(frozen=True)
class LoggingConfig:
    """Progress reporting and routing diagnostics (``log.jsonl`` gets a row every step regardless).

    Args:
        interval: steps between progress-bar and TensorBoard updates.
        metrics_interval: routers compute diagnostics (which sync the host) on step 1, every this many steps and
            the last; training is unaffected. 1 (default) matches the committed results.
        tensorboard / tensorboard_dir: also write TensorBoard events (default dir ``<run dir>/tensorboard``).
        trace_step: profile this step (>= 2; 0: none) into ``<run dir>/trace/`` (:mod:`repro.training.trace`).
    """

    interval: int = 1
    metrics_interval: int = 1
    tensorboard: bool = False
    tensorboard_dir: str | None = None
    trace_step: int = 0

    def __post_init__(self) -> None:
        check_minimums(self, "logging", interval=1, metrics_interval=1)
        if self.tensorboard_dir is not None and not self.tensorboard_dir:
            raise ValueError("logging.tensorboard_dir must be None or a non-empty path")
        if self.trace_step and self.trace_step < 2:
            raise ValueError(f"logging.trace_step must be 0 (no trace) or >= 2, got {self.trace_step}")


@dataclass(frozen=True)
class ValidationConfig:
    """Held-out loss every ``interval`` steps (0: none) and at the last, over ``iters`` micro-batches per rank."""

    interval: int = 0
    iters: int = 2

    def __post_init__(self) -> None:
        check_minimums(self, "validation", interval=0, iters=0)


@dataclass(frozen=True)
class RunConfig:
    """A run minus output dir and process count: ``name``, ``seed`` (init, router noise, data) and sections."""

    name: str
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    router: RouterSpec = field(default_factory=RouterSpec)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    def __post_init__(self) -> None:
        if self.schedule.min_lr > self.optimizer.lr:
            raise ValueError(f"schedule.min_lr {self.schedule.min_lr} is above optimizer.lr {self.optimizer.lr}")
        check_minimums(self, seed=0)

    @property
    def seq_length(self) -> int:
        return self.model.seq_length or self.model.flavour_config().seq_length

    def router_options(self) -> dict[str, Any]:
        """``router.options``; ``schedule_steps`` defaults to ``schedule.steps`` so step schedules span the run."""
        options = dict(self.router.options)
        name = self.router.name
        if name and name != MEGATRON_ROUTER and "schedule_steps" not in options:
            if "schedule_steps" in _router_option_fields(name):
                options["schedule_steps"] = self.schedule.steps
        return options

    def router_options_in_effect(self) -> dict[str, Any]:
        """Every router option with its effective value (:meth:`router_options` over the router's defaults;
        ``{}`` if dense), as ``--show`` prints and ``config.json`` records."""
        name = self.router.name
        if not name:
            return {}
        given = self.router_options()
        if name == MEGATRON_ROUTER:
            return given
        import routers

        missing = dataclasses.MISSING
        defaults = {f.name: f.default_factory() if f.default is missing else f.default
                    for f in dataclasses.fields(routers.router_class(name).Config)
                    if f.name not in ("hidden_size", "num_experts", "top_k")
                    and (f.default is not missing or f.default_factory is not missing)}
        return {**defaults, **given}

    def model_kwargs(self) -> dict[str, Any]:
        """Arguments for :func:`repro.model.builder.build_model` besides vocabulary, sequence length, precision."""
        return dict(flavour=self.model.flavour_config(), router_name=self.router.name,
                    router_options=self.router_options() if self.router.name else None, backend=self.model.backend,
                    backend_options=self.model.backend_options, fused_cross_entropy=self.model.fused_cross_entropy,
                    seed=self.seed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def stored_dict(cls, data: Any) -> dict[str, Any] | None:
        """A stored ``config.json`` ``experiment`` normalised by :meth:`to_dict` (missing fields take defaults,
        so older runs compare equal); None if invalid."""
        try:
            return cls.from_dict(data).to_dict()
        except (ReproError, TypeError, ValueError):
            return None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "config") -> RunConfig:
        """Rebuild a config from :meth:`to_dict`'s output (ReproError naming ``origin`` on a bad field)."""
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), dict(data)))
        except OmegaConfBaseException as exc:
            raise ReproError(f"{origin}: {_omegaconf_message(exc)}") from None
        except ValueError as exc:
            raise ReproError(f"{origin}: {exc}") from None


def _omegaconf_message(exc: Exception) -> str:
    """OmegaConf's first message line, with the full key it concerns."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    key = getattr(exc, "full_key", None)
    return f"{key}: {text}" if key and key not in text else text


def _router_option_fields(router: str) -> dict[str, Any]:
    """``{option: type}`` of a router's options (ReproError listing the valid routers for an unknown one)."""
    if router == MEGATRON_ROUTER:
        return {name: float | None for name in MEGATRON_ROUTER_OPTIONS}
    import routers

    try:
        cls = routers.router_class(router)
    except ValueError as exc:
        raise ReproError(f"router.name: {exc}; or '{MEGATRON_ROUTER}', or null for a dense model") from None
    hints = typing.get_type_hints(cls.Config)
    return {name: hints[name] for name in cls.Config.option_names()}


def typed_router_options(router: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` converted to the router's config field types (ReproError on unknown options or bad types)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    fields = _router_option_fields(router)
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ReproError(f"unknown option(s) {', '.join(unknown)} for router '{router}'; "
                         f"valid: {', '.join(sorted(fields)) or '(none)'}")
    if not options:
        return {}
    schema = dataclasses.make_dataclass(f"{router}_options", [(name, fields[name]) for name in options])
    try:
        return dict(OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(schema), dict(options))))
    except OmegaConfBaseException as exc:
        raise ReproError(f"router.options.{_omegaconf_message(exc)} (router '{router}')") from None


def check_router_options(config: RunConfig) -> None:
    """Build the router's config with the model's real sizes so a bad value fails now (ReproError); ``config``
    comes from :func:`apply_overrides`, which has typed its options and given a dense model none."""
    name = config.router.name
    if name is None or name == MEGATRON_ROUTER:
        return
    import routers

    try:
        flavour = config.model.flavour_config()
    except ValueError as exc:
        raise ReproError(f"model: {exc}") from None
    if flavour.num_experts is None:
        raise ReproError(f"router.name: flavour '{flavour.name}' is dense and takes no router (got '{name}')")
    cls = routers.router_class(name)
    try:
        cls.Config(hidden_size=flavour.hidden_size, num_experts=flavour.num_experts, top_k=flavour.top_k,
                   **config.router_options())
    except (ValueError, TypeError) as exc:
        raise ReproError(f"router '{name}' options {dict(config.router.options)}: {exc}") from None
    segment = config.router_options_in_effect().get("segment_len")
    if isinstance(segment, int) and segment > config.seq_length:  # Lory: segments cut each sequence
        raise ReproError(f"router.options.segment_len={segment} is above the sequence length {config.seq_length}: "
                         "a segment lies within one sequence (at most the sequence length)")


def apply_overrides(config: RunConfig, assignments: Iterable[str]) -> RunConfig:
    """Apply dot-list overrides (the ``--set`` options) to a config.

    Keys are dotted paths (``schedule.steps=100``); ``router.options.NAME=VALUE`` is typed by the router's field;
    ``router.name=NAME`` drops the previous router's options; ``null`` sets None. Later assignments win.

    Raises:
        ReproError: malformed assignment, unknown key (listing valid keys), bad type or range; one line.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    items = list(assignments)
    for item in items:
        if "=" not in item or not item.partition("=")[0].strip():
            raise ReproError(f"--set expects key=value, got '{item}'")
    plain = [i for i in items if not i.startswith("router.options.")]
    option_items = [i[len("router.options."):] for i in items if i.startswith("router.options.")]
    try:
        data = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(config), OmegaConf.from_dotlist(plain)))
    except OmegaConfBaseException as exc:
        message = _omegaconf_message(exc)
        if "not in" in message and "Did you mean" not in message:
            keys = flatten(dataclasses.asdict(config), keep=("options", "backend_options"))
            valid = [f"{k}.<option>" if k.endswith("options") else k for k in keys if k != "name"]
            message += f"; valid keys: {', '.join(valid)}"
        raise ReproError(f"--set {message}") from None
    router = data["router"]["name"]
    options = {} if router != config.router.name else dict(config.router.options)
    try:
        options.update(OmegaConf.to_container(OmegaConf.from_dotlist(option_items)))
    except OmegaConfBaseException as exc:
        raise ReproError(f"--set router.options.{_omegaconf_message(exc)}") from None
    if option_items and router is None:
        raise ReproError("--set router.options.*: the experiment has no router (router.name=null)")
    data["router"]["options"] = typed_router_options(router, options) if router is not None else {}
    updated = RunConfig.from_dict(data, origin=f"experiment '{config.name}'")
    check_router_options(updated)
    return updated
