"""Baseline routers: Switch/dMoE, ReMoE, Expert Choice, Hash, Lory, SparseMixer-v2 (one file each)."""
