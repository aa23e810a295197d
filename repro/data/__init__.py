"""Data: Pile reader, GPT-2 BPE tokenizer, megatron-core indexed datasets, the embedded mini-pile, similarity
batching, token counts and ``python -m repro data`` (the modules: docs/development.md, "Layout").

Importing this package imports none of its modules (megatron-core is imported only by what needs it).
"""

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_megatron_import() -> Iterator[None]:
    """Silence megatron-core's import-time notice that TransformerEngine/Apex are absent (expected on CPU)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        yield
