"""Argument checks shared by the public API (plain Python: safe for light modules)."""


def check_int(name: str, value, minimum: int = 1) -> int:
    """Returns `value` if it is an int >= `minimum` (bool is not accepted), else raises.

    Raises:
        ValueError: "{name} must be an integer >= {minimum}, got {value!r}."
    """
    # bool is an int subclass; True would silently mean 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value
