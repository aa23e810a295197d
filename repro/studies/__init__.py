"""The studies: the engine that runs a study's runs (engine.py), the registry behind ``python -m repro study NAME``
(registry.py), the studies with options of their own (mini.py, ablation.py, efficiency.py, router_costs.py), each
with its write-up beside it (``*_writeup.py``, declared in the study's ``WRITEUPS``), and ``report writeup``
(writeup.py), which runs every study's."""
