"""The one error type the command line reports as a single line (``error: ...``, exit status 2)."""

from __future__ import annotations

from collections.abc import Sequence


class ReproError(Exception):
    """A problem with the user's input (file, config value, name), with a one-line message naming it."""


def unknown_name(kind: str, name: str, valid: Sequence[str]) -> str:
    """``unknown router 'dirmo'; did you mean 'dirmoe'? valid: ...`` (a suggestion only if one is close)."""
    import difflib

    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ";"
    return f"unknown {kind} '{name}'{hint} valid: {', '.join(valid)}"
