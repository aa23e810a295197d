"""Named experiments, derived from the router registry: ``<router>-tiny`` and ``<router>-185m`` for every
registered router (entry-point routers included), ``dense-*``, ``megatron-*`` (megatron-core's TopKRouter)
and ``<router>+<variant>-*`` for the variants a router declares (``Router.variants``), where ``*`` is a model
flavour (``repro.flavours``). Each is the flavour's recipe (:data:`RECIPES`) with the router set, then the router's
declared overrides for that flavour (``Router.recipe_overrides``) as dot-lists. No router is special-cased here.

The 185M recipe follows ReMoE's published launch script (thu-ml/ReMoE, ``train_llama_*_remoe.sh``): micro batch
16, global batch 512 x 1024 tokens, 60k iterations, LR 5e-4 cosine to 5e-5, warmup 0.01, clip 1.0, bf16,
Megatron's default AdamW, eval every 1000 iterations over 100 batches, checkpoint every 2500.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from repro.config import (
    MEGATRON_ROUTER,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    RouterSpec,
    RunConfig,
    ScheduleConfig,
    ValidationConfig,
    apply_overrides,
)
from repro.errors import ReproError, unknown_name

DENSE = "dense"


def _recipe(router: str | None, *, flavour: str, model: dict, optimizer: dict, schedule: dict, data: dict,
            checkpoint: int, validation: dict) -> RunConfig:
    return RunConfig(
        name=f"{router or DENSE}-{flavour}",
        model=ModelConfig(flavour=flavour if router else f"{flavour}-dense", **model),
        router=RouterSpec(name=router), optimizer=OptimizerConfig(**optimizer), schedule=ScheduleConfig(**schedule),
        data=DataConfig(**data), checkpoint=CheckpointConfig(interval=checkpoint), logging=LoggingConfig(interval=10),
        validation=ValidationConfig(**validation),
    )


#: flavour -> recipe(router or None): the run settings of that model's experiments.
RECIPES: dict[str, Callable[[str | None], RunConfig]] = {
    # CPU-sized: the tiny flavour on the embedded mini-pile (same pipeline as The Pile). Tests use synthetic data.
    "tiny": functools.partial(
        _recipe, flavour="tiny", model={},
        optimizer=dict(lr=2e-3, weight_decay=0.01, beta1=0.9, beta2=0.999, clip_grad=1.0),
        schedule=dict(steps=200, warmup_fraction=0.05, min_lr=2e-4),
        data=dict(source="mini-pile", micro_batch_size=4, global_batch_size=8), checkpoint=100,
        validation=dict(interval=50, iters=2)),
    "185m": functools.partial(
        _recipe, flavour="185m", model=dict(seq_length=1024, precision="bf16"),
        optimizer=dict(lr=5e-4, weight_decay=0.01, beta1=0.9, beta2=0.999, eps=1e-8, clip_grad=1.0),
        schedule=dict(steps=60_000, warmup_fraction=0.01, min_lr=5e-5),
        data=dict(source="pile:data/pile/pile_text_document", micro_batch_size=16, global_batch_size=512),
        checkpoint=2500, validation=dict(interval=1000, iters=100)),
}


def experiment_routers(variants: bool = False) -> list[str]:
    """Registered routers (and ``<router>+<variant>`` with ``variants``), megatron's TopKRouter, and dense."""
    import routers

    names = routers.available_routers()
    declared = [f"{n}+{v}" for n in names for v in routers.router_class(n).variants] if variants else []
    return [*names, *declared, MEGATRON_ROUTER, DENSE]


def _declared_overrides(router: str | None, variant: str | None, flavour: str) -> tuple[str, ...]:
    if router in (None, MEGATRON_ROUTER):
        return ()
    import routers

    try:
        cls = routers.router_class(router)
    except ValueError as exc:
        raise ReproError(str(exc)) from None
    if variant is not None and variant not in cls.variants:
        raise ReproError(f"router '{router}' has no variant '{variant}'; valid: {', '.join(cls.variants) or '(none)'}")
    return (*cls.recipe_overrides.get(flavour, ()), *(cls.variants[variant] if variant else ()))


def build_experiment(router: str, flavour: str) -> RunConfig:
    """The experiment of ``router`` (a name, ``<router>+<variant>``, or ``dense``) at ``flavour`` (:data:`RECIPES`).

    Raises:
        ReproError: an unknown flavour, router or variant, or declared overrides not fitting the recipe.
    """
    if flavour not in RECIPES:
        raise ReproError(f"unknown flavour '{flavour}'; valid: {', '.join(RECIPES)}")
    base, _, variant = router.partition("+")
    name = None if base == DENSE else base
    config = apply_overrides(RECIPES[flavour](name), _declared_overrides(name, variant or None, flavour))
    return dataclasses.replace(config, name=f"{router}-{flavour}") if variant else config


def experiment_names() -> list[str]:
    """All experiment names (``<router>-<flavour>``, variants included), sorted."""
    return sorted(f"{router}-{flavour}" for router in experiment_routers(variants=True) for flavour in RECIPES)


def get_experiment(name: str) -> RunConfig:
    """The experiment called ``name`` (ReproError listing the valid names for an unknown one)."""
    router, _, flavour = name.rpartition("-")
    if flavour not in RECIPES or router not in experiment_routers(variants=True):
        raise ReproError(unknown_name("experiment", name, experiment_names()))
    return build_experiment(router, flavour)


def describe(config: RunConfig) -> str:
    """One line describing an experiment for ``--list``."""
    router = config.router.name or DENSE
    seq = config.model.seq_length or "flavour"
    return (f"{config.name:<24} router={router:<14} flavour={config.model.flavour:<17} "
            f"steps={config.schedule.steps:<6} batch={config.data.global_batch_size}x{seq} "
            f"lr={config.optimizer.lr:g}->{config.schedule.min_lr:g}")
