"""The studies: the engine that runs a study's runs (engine.py), the registry behind ``python -m repro study NAME``
(registry.py), and the studies with options of their own (mini.py, ablation.py, efficiency.py)."""
