"""Words of messages: a count with its noun in the right number.

Example:
>>> counted(1, "device"), counted(8, "device"), counted(2, "entry", "entries")
('1 device', '8 devices', '2 entries')
"""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` and `noun`, plural (`noun + "s"` unless given) unless one.

    Args:
        count: how many.
        noun: the singular.
        plural: the plural, when not `noun + "s"`.

    Returns:
        E.g. `"1 device"`, `"36 weights"`.

    Example:
    >>> counted(1, "table row")
    '1 table row'
    """
    return f"{count} {noun if count == 1 else (plural or noun + 's')}"
