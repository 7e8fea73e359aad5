"""Errors of the launcher."""


class LaunchError(ValueError):
    """Bad launcher input (missing script, bad job file, bad counts); nothing was started.

    Example:

    ```python
    try:
        td.launch.launch("train.py", num_workers=0)
    except td.launch.LaunchError as e:
        print(e)   # num_workers must be an integer >= 1, got 0.
    ```
    """
