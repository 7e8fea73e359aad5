"""Argument checks shared by the public API (plain Python: safe for light modules)."""


def is_int(value) -> bool:
    """Whether `value` is an int; bool is not (an int subclass, True would silently mean 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int = 1) -> int:
    """Returns `value` if it is an int >= `minimum` (bool is not accepted), else raises.

    Raises:
        ValueError: "{name} must be an integer >= {minimum}, got {value!r}."
    """
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value
