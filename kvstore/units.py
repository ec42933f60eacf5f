"""Human units for sizes (``2GiB``) and durations (``3d``), as used in the cluster file and by kvctl."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"64KiB"`` → 65536. Integers pass through. Raises ValueError naming the accepted units."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    match = _NUMBER_UNIT.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"bad size {text!r}: use a number with B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str | int | float) -> float:
    """``"3d"`` → 259200.0 seconds; ``"90"`` means seconds. Raises ValueError naming the accepted units."""
    if isinstance(text, int | float):
        if text <= 0:
            raise ValueError(f"duration must be positive, got {text}")
        return float(text)
    match = _NUMBER_UNIT.match(text)
    unit = (match.group(2).lower() or "s") if match else None
    if match is None or unit not in _DURATION_UNITS:
        raise ValueError(f"bad duration {text!r}: use a number with s, m, h, d or w (e.g. 30s, 12h, 3d)")
    seconds = float(match.group(1)) * _DURATION_UNITS[unit]
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return seconds


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
