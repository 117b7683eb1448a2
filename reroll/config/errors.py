"""The one error type that the CLI turns into a clean message and exit code 2."""

from __future__ import annotations


class ConfigError(Exception):
    """A problem with what the user asked for: a config field, a data row, a path.

    The message names the field path (or file and line) and what was wrong; the CLI prints it
    without a traceback and exits 2.
    """


class RunStopped(RuntimeError):
    """A run that cannot go on learning: weights out of sync, updates that keep coming out
    non-finite, a reward that keeps failing. The message names the step and the cause; the CLI
    prints it without a traceback and exits 1."""
