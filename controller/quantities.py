"""Integers as the API server writes quantities (`resource.Quantity`'s canonical form), so that
what we publish reads back equal: `decimal_quantity` (DecimalSI) and `binary_quantity` (BinarySI).

Pure functions; they know nothing of devices.
"""

from __future__ import annotations

_DECIMAL_SUFFIXES = ("", "k", "M", "G", "T", "P", "E")
_BINARY_SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


def decimal_quantity(n: int) -> str:
    """The canonical form the API server writes for integer `n` in DecimalSI (1000 -> "1k")."""
    if n == 0:
        return "0"
    step = 0
    while step < len(_DECIMAL_SUFFIXES) - 1 and n % 1000 == 0:
        n //= 1000
        step += 1
    return f"{n}{_DECIMAL_SUFFIXES[step]}"


def binary_quantity(n: int) -> str:
    """The canonical form the API server writes for integer `n` in BinarySI.

    Like Go's `resource.NewQuantity(n, resource.BinarySI).String()` (what NVIDIA's driver
    sends): the largest power-of-1024 suffix that keeps `n` whole, and below 1024 the
    DecimalSI form. Publishing the server's own canonical form keeps `spec` comparisons
    with what the server returns exact.
    """
    if -1024 < n < 1024:
        return decimal_quantity(n)
    step = 0
    while step < len(_BINARY_SUFFIXES) - 1 and n % 1024 == 0:
        n //= 1024
        step += 1
    return f"{n}{_BINARY_SUFFIXES[step]}"
