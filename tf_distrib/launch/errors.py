"""Errors of the launcher."""


class LaunchError(ValueError):
    """Bad launcher input (missing script, bad job file, bad counts); nothing was started."""
