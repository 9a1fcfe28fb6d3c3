"""Byte sizes as users write them (``'20GiB'``, ``'512 MB'``, ``1.5e9``) and as we print them."""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_NUMBER = re.compile(r"\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*")
# Anything above this is a typo, not a machine (1 EiB).
_LARGEST = 2**60


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def parse_bytes(value: int | float | str, *, field: str = "budget") -> int:
    """``'20GiB'``, ``'512 MB'``, ``'1.5e9'`` or a number of bytes -> int bytes.

    Raises:
        TypeError: not a number or a string.
        ValueError: not a size, not finite, not positive, or absurdly large; the message names ``field``.
    """
    example = "e.g. '20GiB', '512MB' or a number of bytes"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{field}={value!r} ({type(value).__name__}) must be a number of bytes or a string, {example}")
    if isinstance(value, str) and value.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        raise ValueError(f"{field}={value!r} is not a finite size; {example}")
    if isinstance(value, str):
        m = _NUMBER.fullmatch(value)
        unit = m.group(2).lower() if m else ""
        if not m or (unit and unit not in _UNITS):
            raise ValueError(
                f"{field}={value!r} is not a size; write a number with an optional unit "
                f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), {example}"
            )
        number = float(m.group(1)) * _UNITS[unit or "b"]
    else:
        number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{field}={value!r} is not a finite size; {example}")
    if number > _LARGEST:
        raise ValueError(f"{field}={value!r} is larger than any machine ({format_bytes(number)}); {example}")
    n = int(number)
    if n <= 0:
        raise ValueError(f"{field}={value!r} must be positive, {example}")
    return n
