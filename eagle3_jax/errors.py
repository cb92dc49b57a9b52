"""The one exception type that command lines turn into a one-line message."""


class Eagle3Error(ValueError):
    """Bad input or configuration: the message names the problem and the fix."""


def differing_keys(have: dict, want: dict) -> list[str]:
    """The keys whose values differ between two records (either side missing one counts): what a
    refusal to resume or reuse names."""
    return sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
