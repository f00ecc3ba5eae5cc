"""The ``shardwise`` command: one typer app, one module per verb under ``shardwise.commands``.

Start-up matters (``shardwise plan`` should feel instant), so ``main`` registers only the
module of the verb being run; ``--help`` or an unknown verb registers them all. ``app``
(all verbs) is built on first access for code that imports it.
"""

import importlib
import sys

import typer

from shardwise.errors import ShardwiseError

# verb -> module under shardwise.commands whose register(app) adds it. Add a verb here.
VERBS: dict[str, str] = {
    "plan": "plan",
    "catalog": "catalog",
    "validate": "validate",
    "sweep": "sweep",
    "report": "report",
    "ring": "ring",
    "probe": "probe",
    "run": "run",
    "make-checkpoint": "run",
    "bench": "bench",
    "quantize": "quantize",
}


def build_app(verb: str | None = None) -> typer.Typer:
    """The typer app with ``verb``'s module registered, or every module when ``verb`` is None."""
    app = typer.Typer(
        name="shardwise",
        help="Plan, run and profile LLM inference split across a cluster of boxes.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )

    @app.callback()
    def _group() -> None:
        """Plan, run and profile LLM inference split across a cluster of boxes."""

    modules = [VERBS[verb]] if verb in VERBS else list(dict.fromkeys(VERBS.values()))
    for name in modules:
        importlib.import_module(f"shardwise.commands.{name}").register(app)
    return app


def __getattr__(name: str):
    if name == "app":
        return build_app()
    raise AttributeError(name)


def main() -> None:
    """Entry point: run the app, print ShardwiseError as one line on stderr and exit 2."""
    verb = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    app = build_app(verb if verb in VERBS else None)
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
