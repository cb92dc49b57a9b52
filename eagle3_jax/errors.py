"""The one exception type that command lines turn into a one-line message."""


class Eagle3Error(ValueError):
    """Bad input or configuration: the message names the problem and the fix."""
