"""The one error type a user sees: a message that says what was wrong and what to do."""


class EdgespecError(Exception):
    """A problem the user can act on; the CLI prints it on one line without a traceback."""


def is_int(value, low=None, high=None) -> bool:
    """An int, not a bool, in [low, high) where they are given."""
    return isinstance(value, int) and not isinstance(value, bool) and \
        (low is None or low <= value) and (high is None or value < high)


def is_number(value) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SettingError(EdgespecError):
    """An invalid option; `name` is the option's flat name (temperature, stop, ...)."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name
