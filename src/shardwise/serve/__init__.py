"""`shardwise serve`: an OpenAI-compatible HTTP server over the sharded runtime.

Rank 0 holds the HTTP server (``app``) and the scheduler (``scheduler``, driven by
``engine``); every step it broadcasts which sequences run and with which tokens
(``steps``), and every rank runs the same forward. ``protocol`` parses and shapes the
OpenAI wire format, ``text`` turns token ids into streamed text with stop strings,
``metrics`` holds the Prometheus series and ``rank`` is what each process runs.
"""
