"""Training on megatron-core: named experiments, the loop, checkpoints, the ``train`` command.

Public API::

    from repro.training import get_experiment, apply_overrides, experiment_names, train
    exp = apply_overrides(get_experiment("dirmoe-tiny"), ["steps=50"])
    summary = train(exp, "runs/dirmoe-tiny")            # or resume=True to continue a run

``train`` lives in :mod:`repro.training.loop` and imports megatron-core when first called.
"""

from repro.training.experiments import (
    EXPERIMENTS,
    Experiment,
    apply_overrides,
    experiment_names,
    get_experiment,
)


def train(*args, **kwargs):
    """Train an experiment: see :func:`repro.training.loop.train` (imported on first use)."""
    from repro.training.loop import train as _train

    return _train(*args, **kwargs)


__all__ = ["EXPERIMENTS", "Experiment", "apply_overrides", "experiment_names", "get_experiment", "train"]
