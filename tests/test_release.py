"""``train()`` releases what it built: a loop of trainings in one process (a notebook, a sweep, this test session)
holds memory flat, whether its runs finish, stop early or fail, and an error a caller keeps does not keep the
run's model alive.

megatron's DDP wrapper and the dispatcher's last routing probabilities form a cycle through C++ that the garbage
collector cannot see (``repro.training.optim.release_ddp``), so a run that skipped its teardown would keep its
model, optimizer state and process groups for the life of the process. The runs are tiny (2 layers, 64-token
sequences, 2 steps, CPU); ``tests/test_gpu.py`` checks the same on CUDA with megatron's optimizer and
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from repro.config import RunConfig, apply_overrides
from repro.errors import ReproError
from repro.experiments import get_experiment

TINY = [
    "data.source=synthetic",
    "model.seq_length=64",
    "data.micro_batch_size=2",
    "data.global_batch_size=4",
    "data.synthetic_samples=4",
    "schedule.steps=2",
    "schedule.warmup_steps=0",
    "validation.interval=0",
    "checkpoint.interval=0",
]
#: One router of each dispatch shape: top-1 (Switch), a variable number of experts per token through the
#: alltoall dispatcher (DirMoE, ReMoE).
ROUTERS = ("switch", "dirmoe", "remoe")


def _experiment(router: str, extra: tuple[str, ...] = ()) -> RunConfig:
    return apply_overrides(get_experiment(f"{router}-tiny"), TINY + list(extra))


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage Python can reach after a full collection, each storage counted once."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # isinstance would touch deprecated module proxies; a compiled graph's fake tensors (another test's
        # torch.compile) own no memory, and asking for their data pointer warns
        if issubclass(type(obj), torch.Tensor) and not issubclass(type(obj), FakeTensor):
            try:
                storage = obj.untyped_storage()
                storage.data_ptr()
            except RuntimeError:  # a storage without data (meta, or freed under a subclass) owns no memory
                continue
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


@pytest.fixture
def built_models(monkeypatch) -> list[weakref.ref]:
    """A weak reference to every model the trainer builds from here on."""
    from repro.training import trainer as trainer_module

    refs: list[weakref.ref] = []
    real = trainer_module.build_model_for

    def recording(*args, **kwargs):
        model = real(*args, **kwargs)
        refs.append(weakref.ref(model))
        return model

    monkeypatch.setattr(trainer_module, "build_model_for", recording)
    return refs


def alive(refs: list[weakref.ref]) -> int:
    """How many of the referenced models are still alive after a full collection."""
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_a_loop_of_trainings_holds_memory_flat(tmp_path, built_models):
    from repro.training.trainer import train

    footprints = []
    for round_ in range(2):
        for router in ROUTERS:
            train(_experiment(router), tmp_path / f"{round_}-{router}", progress=False)
            assert alive(built_models) == 0, f"round {round_}: {router}'s model outlived train()"
        footprints.append(live_tensor_bytes())
    assert len(built_models) == 2 * len(ROUTERS)
    # The first round may create process-wide state once (megatron's global buffers, a router's constants);
    # a second round of the same runs adds nothing.
    assert footprints[1] == footprints[0], footprints


def test_runs_that_stop_or_fail_release_their_model_even_while_the_error_is_kept(tmp_path, built_models, monkeypatch):
    from repro.training import trainer as trainer_module
    from repro.training.preemption import RunStopped

    # Stopped after a step as if killed: a partial summary.
    assert trainer_module.train(_experiment("dirmoe"), tmp_path / "stop", progress=False, stop_after=1) == {
        "experiment": "dirmoe-tiny", "stopped_at": 1}
    assert alive(built_models) == 0

    # A non-finite loss and a stop signal end the run with an error; its traceback holds train()'s frames,
    # which must not hold the trainer.
    real_step, real_fit = trainer_module.Trainer.train_step, trainer_module.Trainer.fit

    def non_finite_at_step_2(self):
        row = real_step(self)
        if row.step == 2:
            raise trainer_module.NonFiniteLoss(f"experiment '{self.config.name}': loss is nan at step 2")
        return row

    def stopped_by_a_signal(self, stop_after=None):
        real_fit(self, 1)
        self.stopped_by = "SIGUSR1"
        return False

    kept = []
    cases = ((non_finite_at_step_2, ReproError, "train_step"), (stopped_by_a_signal, RunStopped, "fit"))
    for patch, error, name in cases:
        with monkeypatch.context() as m:
            m.setattr(trainer_module.Trainer, name, patch)
            with pytest.raises(error) as excinfo:
                trainer_module.train(_experiment("remoe"), tmp_path / name, progress=False)
        kept.append(excinfo)
        assert alive(built_models) == 0, f"{excinfo.value!r} keeps the model alive"
    assert "loss is nan at step 2; the run stopped" in str(kept[0].value)
    assert kept[1].value.step == 1 and kept[1].value.signal == "SIGUSR1"
    assert len(built_models) == 3
