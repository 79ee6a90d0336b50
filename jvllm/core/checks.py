"""The checks that engine options share, each raising one ValueError that names the option,
what it got and what is allowed (every bad engine option is a ValueError, as in vLLM)."""

from collections.abc import Collection


def check_int(name: str, value, minimum: int = 1, *, optional: bool = False, why: str = "") -> None:
    """`value` is an int (not a bool) >= `minimum`, or None where `optional`; `why` says
    more of what is allowed (e.g. "0 = off")."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        allowed = f"{'None or ' if optional else ''}an int >= {minimum}"
        raise ValueError(f"{name} must be {allowed}{f' ({why})' if why else ''}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")  # noqa: TRY004


def check_choice(name: str, value, choices: Collection, *, optional: bool = False) -> None:
    """`value` is one of `choices`, or None where `optional`."""
    if optional and value is None:
        return
    if value not in choices:
        allowed = f"None or one of {tuple(choices)}" if optional else f"one of {tuple(choices)}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
