"""User-facing errors: one line that names the field and the fix."""

import difflib
from collections.abc import Iterable


class ShardwiseError(Exception):
    """An error caused by input; the CLI prints its message as one line and exits 2."""


def shown(value: object) -> str:
    """``repr(value)`` cut to 60 characters: a value read from a file, quoted in an error line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def unknown_name(kind: str, name: str, known: Iterable[str]) -> ShardwiseError:
    """Error for an unknown catalog name that suggests the closest known names."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
    return ShardwiseError(f"unknown {kind} '{name}': {hint}")


def validation_message(exc: Exception) -> str:
    """A msgspec validation error as ``path: message`` (``Expected `float` > 0.0 - at `$.memory_gb```
    becomes ``memory_gb: Expected `float` > 0.0``)."""
    message, _, where = str(exc).rpartition(" - at `$")
    if not message:
        return str(exc)
    return f"{where.rstrip('`').lstrip('.')}: {message}"
