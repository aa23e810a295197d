"""The studies behind ``python -m repro study NAME`` (registry.py, engine.py) and their write-ups (writeup.py)."""
