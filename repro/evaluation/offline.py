"""Keep lm-eval and Hugging Face datasets off the network: the suite's machines reach no hub, so every place
that runs lm-eval calls :func:`ensure_offline` before ``datasets`` / ``lm_eval`` are imported (``datasets``
reads the variables once, at import).
"""

from __future__ import annotations

import os

OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def ensure_offline() -> None:
    """Set :data:`OFFLINE_ENV` where unset (an explicit ``HF_DATASETS_OFFLINE=0`` stays)."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
