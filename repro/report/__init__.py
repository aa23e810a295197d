"""Presentation of the records: tables, compute parity, published numbers, plots, checks, write-up wording."""
