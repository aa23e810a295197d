"""What the study workers' fork server imports once (``repro.studies.engine``: each CPU run is a fork of that server, spared
the ~4 s of importing torch, megatron-core and the suite). Imported by the server alone. megatron-core's notices
that TransformerEngine and Apex are absent (expected on CPU) are silenced while it imports, else they would reach
the terminal, which the server writes to; the filters are restored afterwards, for the runs forked from it. Not
lm-eval's runner: it brings pyarrow's allocator thread, and the server forks.
"""

import importlib

from routers.registry import quiet_megatron_import

#: What every run needs (not the light study modules: a worker imports those when unpickling its task).
MODULES = ("repro.training.trainer", "repro.training.inference", "repro.evaluation.harness", "repro.records.store",
           "repro.analysis", "routers.dirmoe", "baselines", "megatron.core.models.gpt", "megatron.core.distributed")

with quiet_megatron_import():
    for _name in MODULES:
        importlib.import_module(_name)
