"""The one exception type that means "the user asked for something that cannot work"."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input (options, data, checkpoint): reported as one line on stderr, exit code 2."""
