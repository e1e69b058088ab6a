"""The units the benchmark's report writes its figures in."""

MIB = 2**20


def mib(n: float) -> str:
    """`n` bytes in MiB, with thousands separated: `mib(3 * 2**20)` is "3.0"."""
    return f"{n / MIB:,.1f}"
