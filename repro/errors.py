"""The one error type the command line reports as a single line (``error: ...``, exit status 2)."""


class ReproError(Exception):
    """A problem with the user's input (file, config value, name), with a one-line message naming it."""
