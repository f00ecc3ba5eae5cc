"""Helpers for the tests and benchmarks only; nothing in the package imports them.

``netns`` builds shaped network-namespace clusters (needs root and ``ip``/``tc``);
``controlled`` derives checkpoints with controlled behaviour for speculative decoding.
"""
