"""Units: how every layer writes a duration, a share, a byte count, a rate or a count.

A leaf: it imports nothing of the project, so the catalogs' wording, the trace rules, the probes and
the renderers all format with it and a number reads the same in a finding's title and on the page.
The ``format_*`` functions are the report's (units chosen by magnitude); the short ones (``ms``,
``per_it``, ``pct``, ...) are for finding titles and evidence.

Pure functions of plain values. A missing or non-finite value is never printed as "nan" or "None":
the caller gets the ``missing`` text instead, so the report says "not measured" rather than lying.
"""

from __future__ import annotations

import math

#: What the report shows for a number that was not obtained.
NOT_MEASURED = "not measured"

_SECOND_UNITS: tuple[tuple[float, float, str], ...] = (
    # (smallest magnitude in this unit, scale to apply, suffix), largest unit first.
    (1.0, 1.0, "s"),
    (1e-3, 1e3, "ms"),
    (1e-6, 1e6, "µs"),
    (0.0, 1e9, "ns"),
)


_FLOP_UNITS = ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "kFLOP"))


def is_number(value: object) -> bool:
    """A finite int or float (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value)


def _round_significant(value: float, digits: int = 3) -> float:
    # Round before choosing the unit so 0.9996 s prints as "1.00 s", not "1000 ms".
    return float(f"{value:.{digits}g}")


def _seconds_unit(magnitude: float) -> tuple[float, str]:
    for smallest, scale, suffix in _SECOND_UNITS:
        if magnitude >= smallest:
            return scale, suffix
    return 1.0, "s"  # magnitude 0 in the loop above always matches "ns"; unreachable


def _fixed(value: float) -> str:
    """Three significant digits without switching to exponent notation: 123, 45.6, 1.84."""
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_seconds(
    seconds: float | None, *, like: float | None = None, missing: str = NOT_MEASURED
) -> str:
    """0.000123 -> "123 µs", 0.0456 -> "45.6 ms", 1.84 -> "1.84 s", 0 -> "0 s".

    With ``like`` (e.g. the step time), the value is written in the unit of ``like`` when it reads
    well there (0.42 next to a 1.84 s step -> "0.42 s"), so parts of a whole compare at a glance.
    """
    if seconds is None or not is_number(seconds):
        return missing
    if seconds == 0:
        return "0 s"
    rounded = _round_significant(float(seconds))
    scale, suffix = _seconds_unit(abs(rounded))
    if like is not None and is_number(like) and like != 0:
        like_scale, like_suffix = _seconds_unit(abs(_round_significant(float(like))))
        if like_scale < scale and abs(seconds) * like_scale >= 0.01:
            scale, suffix = like_scale, like_suffix
            rounded = float(seconds)
    text = _fixed(rounded * scale)
    return f"{text.replace('-', '−')} {suffix}"


def format_seconds_range(low: float | None, high: float | None, *, missing: str = "") -> str:
    """Two values in one unit: "1.80–1.90 s" (the unit of the larger one)."""
    if low is None or high is None or not (is_number(low) and is_number(high)):
        return missing
    magnitude = max(abs(_round_significant(low)), abs(_round_significant(high)))
    scale, suffix = _seconds_unit(magnitude) if magnitude else (1.0, "s")
    return f"{_fixed(low * scale)}–{_fixed(high * scale)} {suffix}"


def format_per_iteration(
    seconds: float | None, *, like: float | None = None, missing: str = NOT_MEASURED
) -> str:
    """Seconds per iteration: "1.84 s/it", "45.6 ms/it" (``like`` as in :func:`format_seconds`)."""
    text = format_seconds(seconds, like=like, missing="")
    return f"{text}/it" if text else missing


def format_bytes(count: float | None, *, missing: str = NOT_MEASURED) -> str:
    """Binary units: 1536 -> "1.5 KiB", 25769803776 -> "24.0 GiB"."""
    if count is None or not is_number(count):
        return missing
    value = float(count)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or suffix == "TiB":
            return f"{value:.0f} {suffix}" if suffix == "B" else f"{value:.1f} {suffix}"
        value /= 1024
    return missing  # unreachable: the loop returns at "TiB"


def format_percent(fraction: float | None, *, signed: bool = False, missing: str = "") -> str:
    """0.123 -> "12%", 0.034 -> "3.4%"; with ``signed`` a plus sign for positive values."""
    if fraction is None or not is_number(fraction):
        return missing
    percent = fraction * 100
    text = f"{percent:.1f}" if abs(percent) < 10 else f"{percent:.0f}"
    if signed and percent > 0:
        text = "+" + text
    return text.replace("-", "−") + "%"


def format_count(count: float | None, *, missing: str = NOT_MEASURED) -> str:
    """Large counts for parameters: 2_567_000_000 -> "2.57 B", 860_000_000 -> "860 M"."""
    if count is None or not is_number(count):
        return missing
    value = float(count)
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{_fixed(value / threshold)} {suffix}"
    return f"{value:.0f}"


def format_value(value: object) -> str:
    """A scalar of unknown meaning (evidence, inventory): shown as is, floats to 4 digits."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "∞" if value > 0 else "−∞"
        return f"{value:.4g}"
    return str(value)


def format_flops(value: float | None, *, per_second: bool = False) -> str:
    """4.1e12 -> "4.10 TFLOP" ("4.10 TFLOP/s" with ``per_second``)."""
    if value is None or not is_number(value):
        return "not counted"
    suffix = "/s" if per_second else ""
    for scale, unit in _FLOP_UNITS:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}{suffix}"
    return f"{value:.0f} FLOP{suffix}"


def ms(seconds: float | None) -> str:
    """Seconds as a short millisecond string for finding titles ("?" when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    value = seconds * 1e3
    return f"{value:.2f} ms" if value < 10 else f"{value:.0f} ms"


def ms_significant(seconds: float) -> str:
    """Seconds in milliseconds to three significant digits: "0.523 ms", "12.3 ms"."""
    return f"{seconds * 1e3:.3g} ms"


def ms_value(seconds: float, digits: int = 4) -> float | None:
    """Seconds as milliseconds rounded for a probe's data (None when not finite)."""
    return round(seconds * 1e3, digits) if math.isfinite(seconds) else None


def seconds_significant(value: float) -> str:
    """Three significant digits in s, ms or µs, the unit by magnitude: "1.84 s", "523 µs"."""
    magnitude = abs(value)
    if magnitude >= 1 or magnitude == 0:
        return f"{value:.3g} s"
    if magnitude >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"


def per_it(seconds: float) -> str:
    """A per-iteration time for finding titles: "8.72 ms/it" under a second, "1.23 s/it" above."""
    return f"{ms(seconds)}/it" if abs(seconds) < 1 else f"{seconds:.2f} s/it"


def pct(share: float | None) -> str:
    """A share for finding titles: "12%", "0.4%" below one per cent, "0%", "?" when unknown."""
    if share is None:
        return "?"
    return f"{share * 100:.0f}%" if share >= 0.01 or share == 0 else f"{share * 100:.1f}%"


def pct_fine(share: float) -> str:
    """A share to a tenth of a per cent, for a value beside its line: "9.6%", "10%", "12.3%"."""
    return f"{share * 100:.1f}".rstrip("0").rstrip(".") + "%"


def pct_change(fraction: float) -> str:
    """A relative change, signed, to a tenth of a per cent: "+12.3%", "-4.0%"."""
    return f"{fraction * 100:+.1f}%"


def format_gib(count: float) -> str:
    """Bytes in GiB to two decimals, or in MiB below a tenth of a GiB: "1.25 GiB", "80.0 MiB"."""
    gib = 2**30
    return f"{count / gib:.2f} GiB" if count >= gib / 10 else f"{count / 2**20:.1f} MiB"


def format_bytes_rate(value: float | None) -> str:
    """Bytes per second in binary units ("1.5 GiB/s"), "—" when not measured."""
    return f"{format_bytes(value)}/s" if value is not None and is_number(value) else "—"


__all__ = [
    "NOT_MEASURED",
    "format_bytes",
    "format_bytes_rate",
    "format_count",
    "format_flops",
    "format_gib",
    "format_per_iteration",
    "format_percent",
    "format_seconds",
    "format_seconds_range",
    "format_value",
    "is_number",
    "ms",
    "ms_significant",
    "ms_value",
    "pct",
    "pct_change",
    "pct_fine",
    "per_it",
    "seconds_significant",
]
