"""What the forkserver that ``launch_local``'s ranks fork from imports before it serves (``rank_start.context``).

Imported there only, never in a launcher: torch and the rank code load once per launcher process instead of once
per rank, and SIGINT is blocked in the server, so every rank forked from it starts with SIGINT blocked as a spawned
rank did (it inherited the launcher's block around the spawn): ``launch._rank_main`` drops a pending one, then
unblocks it.
"""

import signal

from shardwise.runtime import launch, runner  # noqa: F401  (loaded here so that each forked rank has them)

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
