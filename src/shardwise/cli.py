"""The ``shardwise`` command: one typer app, one module per verb under ``shardwise.commands``."""

import importlib
import sys

import typer

from shardwise.errors import ShardwiseError

app = typer.Typer(
    name="shardwise",
    help="Plan, run and profile LLM inference split across a cluster of boxes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# Each module defines register(app). Add a verb by adding its module here.
_COMMAND_MODULES: tuple[str, ...] = ("plan", "catalog", "validate", "run", "ring", "sweep", "report", "probe", "bench", "quantize")

for _name in _COMMAND_MODULES:
    importlib.import_module(f"shardwise.commands.{_name}").register(app)


def main() -> None:
    """Entry point: run the app, print ShardwiseError as one line on stderr and exit 2."""
    try:
        app(standalone_mode=False)
    except ShardwiseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:  # click usage errors carry their own exit code
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Exit):
            sys.exit(exc.exit_code)
        raise
