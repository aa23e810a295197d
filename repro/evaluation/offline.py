"""Keep lm-eval and Hugging Face datasets off the network.

The suite's machines reach no model or dataset hub, so every place that runs lm-eval calls
:func:`ensure_offline` before ``datasets`` / ``lm_eval`` are imported (``datasets`` reads the variables once,
at import). A variable the user set explicitly (for example ``HF_DATASETS_OFFLINE=0`` on a machine that may
download) is left as it is.
"""

from __future__ import annotations

import os

OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def ensure_offline() -> None:
    """Set ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` unless already set."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
