"""Shared test settings: offline, deterministic, one intra-op thread (the CI machine has 2 cores), and the
fixtures several test files share (built once per test run).

``nox -s tests`` runs the files on every core with pytest-xdist (``--dist loadfile``: a file's tests, and its
module-scoped fixtures, stay in one worker). Files with slow tests are handed out first, so the last file a
worker gets is a short one.
"""

import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Files holding a ``slow`` test first (stable: the order inside a file, and among the fast files, is kept)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


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
