"""Helpers for the tests and benchmarks only; nothing in the package imports them.

``netns`` builds shaped network-namespace clusters (needs root and ``ip``/``tc``);
``controlled`` derives checkpoints with controlled behaviour for speculative decoding;
``llama_gguf`` writes a llama checkpoint as GGUF for llama.cpp (needs the ``gguf`` package).
"""
