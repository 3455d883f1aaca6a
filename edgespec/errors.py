"""The one error type a user sees: a message that says what was wrong and what to do."""


class EdgespecError(Exception):
    """A problem the user can act on; the CLI prints it on one line without a traceback."""


class SettingError(EdgespecError):
    """An invalid option; `name` is the option's flat name (temperature, stop, ...)."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name
