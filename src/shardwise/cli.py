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
    "serve": "serve",
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


def _click_exceptions() -> list:
    """click's exception module and typer's vendored copy (typer >= 0.28 raises its own classes,
    which are not click's subclasses)."""
    import click

    modules = [click.exceptions]
    try:
        from typer._click import exceptions as vendored
    except ImportError:  # an older typer uses click itself
        return modules
    return modules + [vendored]


def main() -> None:
    """Entry point: every user error is one line on stderr starting ``error:`` with exit 2
    (ShardwiseError and click/typer usage errors); Ctrl-C is one line with exit 130; an internal
    bug is one line with exit 1 and a hint to rerun with ``--debug`` for the traceback."""
    debug = "--debug" in sys.argv[1:]
    if debug:
        sys.argv.remove("--debug")
    verb = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    app = build_app(verb if verb in VERBS else None)
    try:
        code = app(standalone_mode=False)
    except ShardwiseError as exc:
        _fail(str(exc), 2)
    except (KeyboardInterrupt, typer.Abort):
        _fail("interrupted", 130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:
        for kinds in _click_exceptions():
            if isinstance(exc, getattr(kinds, "NoArgsIsHelpError", ())):
                exc.show()  # `shardwise` alone (or a verb group) prints its help
                sys.exit(0)
            if isinstance(exc, kinds.ClickException):
                hint = f" (see shardwise {verb} --help)" if verb in VERBS else " (see shardwise --help)"
                _fail(" ".join(exc.format_message().split()) + hint, 2)
        if debug:
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc}; rerun with --debug for the traceback", 1)
    if isinstance(code, int) and code:
        if code == 130:
            _fail("interrupted", 130)
        sys.exit(code)


def _fail(message: str, code: int) -> None:
    """One line on stderr, however the message came: a newline, a control character or a line
    separator from user input (a file's bytes, a flag's value) is printed escaped."""
    line = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
    print(f"error: {line}", file=sys.stderr)
    sys.exit(code)
