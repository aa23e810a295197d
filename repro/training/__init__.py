"""Training on megatron-core: the run config, named experiments, the trainer, checkpoints, ``train``::

    from repro.training import apply_overrides, get_experiment, train
    config = apply_overrides(get_experiment("dirmoe-tiny"), ["schedule.steps=50"])
    summary = train(config, "runs/dirmoe-tiny")         # or resume=True to continue a run
"""

from repro.config import RunConfig, apply_overrides
from repro.experiments import experiment_names, get_experiment


def train(*args, **kwargs):
    """Train a run: see :func:`repro.training.trainer.train` (imports megatron-core on first use)."""
    from repro.training.trainer import train as _train

    return _train(*args, **kwargs)


__all__ = ["RunConfig", "apply_overrides", "experiment_names", "get_experiment", "train"]
