"""The one exception type that command lines turn into a one-line message."""


class Eagle3Error(ValueError):
    """Bad input or configuration: the message names the problem and the fix."""


def differing_keys(have: dict, want: dict) -> list[str]:
    """The keys whose values differ between two records (either side missing one counts): what a
    refusal to resume or reuse names."""
    return sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))


class Stopped(Exception):
    """A run asked to stop (SIGTERM: a preemption notice, `kill`, a job's end) that stopped
    cleanly at a resumable point: command lines print the message and return `EXIT_STATUS`."""

    EXIT_STATUS = 143  # 128 + SIGTERM: what a shell reports for a process SIGTERM ended
