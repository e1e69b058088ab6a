"""On/off switches read from environment variables, with one parser for all.

Every boolean switch of keras-hub-autodist (`KERAS_HUB_AUTODIST_PROGRESS`,
the off-values of `KERAS_HUB_AUTODIST_CACHE`, and `KERAS_HUB_AUTODIST`,
whose startup hook keeps its own copy of these spellings) accepts the same
spellings, in any case and with surrounding blanks. An unset or blank
variable means "not set"; any other value is an `EnvironmentVariableError`
that names the variable, its value and the accepted spellings.

Example:
>>> parse_switch("KERAS_HUB_AUTODIST_PROGRESS", " Off ")
False
>>> read_switch("KERAS_HUB_AUTODIST_PROGRESS", {}) is None
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from keras_hub_autodist.errors import EnvironmentVariableError

ON_VALUES = frozenset({"1", "true", "t", "yes", "y", "on", "enable", "enabled"})
OFF_VALUES = frozenset(
    {"0", "false", "f", "no", "n", "off", "disable", "disabled", "none"}
)


def is_on(text: str) -> bool:
    """Whether `text` is one of the "on" spellings (`1`, `true`, `yes`...).

    Example:
    >>> is_on(" YES ")
    True
    """
    return text.strip().lower() in ON_VALUES


def is_off(text: str) -> bool:
    """Whether `text` is one of the "off" spellings (`0`, `false`, `no`...).

    Example:
    >>> is_off("Disabled")
    True
    """
    return text.strip().lower() in OFF_VALUES


def accepted_values() -> str:
    """The accepted spellings, as a message lists them.

    Example:
    >>> accepted_values().startswith("on: 1, enable")
    True
    """
    return (
        f"on: {', '.join(sorted(ON_VALUES))}; off: {', '.join(sorted(OFF_VALUES))}"
        " (any case)"
    )


def parse_switch(name: str, text: str) -> bool:
    """`text`, the value of environment variable `name`, as on or off.

    Args:
        name: the variable, named in the error.
        text: its value.

    Returns:
        True for an "on" spelling, False for an "off" one.

    Raises:
        EnvironmentVariableError: for any other value.

    Example:
    >>> parse_switch("KERAS_HUB_AUTODIST_PROGRESS", "n")
    False
    """
    if is_on(text):
        return True
    if is_off(text):
        return False
    raise EnvironmentVariableError(
        f"{name} is an on/off switch, and {text!r} is neither. Set it to one "
        f"of the accepted values ({accepted_values()}), or unset it. "
        f"Received: {name}={text!r}"
    )


def read_switch(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """The switch `name` of `environ` (default: `os.environ`).

    Args:
        name: the environment variable.
        environ: where to read it.

    Returns:
        None when unset or blank, else what `parse_switch` makes of it.

    Raises:
        EnvironmentVariableError: for a value that is neither on nor off.

    Example:
    >>> read_switch("KERAS_HUB_AUTODIST_PROGRESS", {"KERAS_HUB_AUTODIST_PROGRESS": "1"})
    True
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "")
    if not text.strip():
        return None
    return parse_switch(name, text)


def read_folder_switch(
    name: str, environ: Mapping[str, str] | None = None
) -> tuple[bool | None, str]:
    """A variable that is either an on/off switch or names a folder, read
    the one way every such variable of the package is read.

    Args:
        name: the environment variable.
        environ: where to read it (default: `os.environ`).

    Returns:
        `(None, "")` when unset or blank; `(False, "")` for an off spelling;
        `(True, "")` for an on spelling (the default folder); `(True, text)`
        for anything else, the folder named.

    Example:
    >>> read_folder_switch("X", {"X": " On "})
    (True, '')
    >>> read_folder_switch("X", {"X": "/tmp/cache"})
    (True, '/tmp/cache')
    >>> read_folder_switch("X", {"X": "0"})
    (False, '')
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "").strip()
    if not text:
        return None, ""
    if is_off(text):
        return False, ""
    if is_on(text):
        return True, ""
    return True, text
