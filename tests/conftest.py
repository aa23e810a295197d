"""Shared test settings: offline, deterministic, one intra-op thread (the CI machine has 2 cores; in the processes
the tests start too), and the fixtures several test files share (built once per test run).

``nox -s tests`` runs the files on every core with pytest-xdist (``--dist loadfile``: a file's tests, and its
module-scoped fixtures, stay in one worker; ``--no-loadscope-reorder``: the files are handed out in the order
below). The longest files go first, so the last file a worker gets is a short one. Without arguments it runs the
quick part, the tests not marked ``slow`` (end-to-end pipelines, long trainings) or ``distributed`` (torchrun);
``nox -s tests -- --all`` runs everything, as CI does.
"""

import dataclasses
import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The commands the tests start (efficiency runs, training processes) inherit it: on 2 cores shared by two test
# workers, a second intra-op thread only spins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

#: The files that take longest (measured on 2 cores), longest first.
LONGEST = ("test_mini.py", "test_ablation.py", "test_efficiency.py", "test_training.py", "test_add_router.py",
           "test_golden.py", "test_preemption.py", "test_launch.py", "test_study.py")


def pytest_collection_modifyitems(config, items):
    """The files of :data:`LONGEST` first, in that order, then the other files holding a ``slow`` test, then the
    rest (stable: the order inside a file, and among the others, is kept)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(LONGEST)), item.path not in slow_files))


@pytest.fixture(scope="session")
def mini_pile(tmp_path_factory) -> Path:
    """The embedded default mini-pile (the mini comparison's corpus, tokenizer and indexed datasets), built
    once per test run and shared by every test that trains on it (read only: training writes its index cache
    in the run directory). Under pytest-xdist the workers share one copy: ``build_mini_pile`` takes a file lock
    and reuses a finished build."""
    from repro.data.minipile import build_mini_pile

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' common temporary root
    path = base / "shared-mini-pile"
    build_mini_pile(path)
    return path


@pytest.fixture(scope="module")
def quick_mini():
    """``python -m repro study mini`` (``repro.studies.mini.main``) scoring the held-out text and analysing the routing on 512
    tokens per domain instead of the comparison's thousands: the same code on less text. Module scope: a rerun
    on the module's runs must see the settings they were made with to reuse them."""
    from repro.studies import mini

    parse = mini.parse

    def quick(argv, prog):
        cfg, fresh = parse(argv, prog)
        return dataclasses.replace(cfg, domain_tokens=512, spec_tokens=512), fresh

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mini, "parse", quick)
        yield
