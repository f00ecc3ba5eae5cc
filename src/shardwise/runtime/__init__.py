"""The torch.distributed runtime. This package module stays torch-free so the CLI can read
its defaults without importing torch (the planning path must not)."""

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a rendezvous or one collective may block before a run fails."""
