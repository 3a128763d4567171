"""Parallelism applied to a single-device model from outside; parallelize.py composes it."""
