"""`python -m shardwise` runs the CLI."""

from shardwise.cli import main

main()
