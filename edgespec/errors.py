"""The one error type a user sees: a message that says what was wrong and what to do."""


class EdgespecError(Exception):
    """A problem the user can act on; the CLI prints it on one line without a traceback."""
