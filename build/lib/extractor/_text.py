"""Text for people and records: timestamps, aligned tables, counted nouns, sizes and the size estimate (the CLI's,
the run report's, the plan's)."""

from __future__ import annotations

import datetime as _dt


def now() -> str:
    """This moment in UTC, to the second (ISO 8601): when a record was written."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns two spaces apart, the header first."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def count(n: int, noun: str) -> str:
    """``1 shard``, ``3 shards``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def size(n: float | None) -> str:
    """``512 B``, ``16.0 KiB``, ``2.1 TiB``: powers of 1024, named so (29.4 TiB is 32.3 TB)."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def estimate(total: int, per_row: dict[str, int]) -> str:
    """What a job will write, before compression: the line ``extractor run`` prints and ``extractor plan`` ends."""
    n_bytes = sum(per_row.values())
    parts = ", ".join(f"{k} {size(v)}" for k, v in per_row.items())
    return (f"{total} images to process; {size(n_bytes)} per row uncompressed ({parts}); store about "
            f"{size(n_bytes * total)} before compression")
