"""Measurements of a real cluster and of the runtime on it, held against the planner.

``probe`` times collectives, links, memory and matmuls in every rank (``probe_fit`` fits
and summarizes them into a probe document and cluster file); ``bench`` runs a checkpoint
with the runtime and lines it up with the planner's prediction, calibrated from a probe.
Sits above ``runtime`` and ``perf``: it uses both, neither imports it.
"""
