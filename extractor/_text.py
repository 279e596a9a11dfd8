"""Text for people: aligned tables and counted nouns (the CLI's and the run report's)."""

from __future__ import annotations


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns two spaces apart, the header first."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def count(n: int, noun: str) -> str:
    """``1 shard``, ``3 shards``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
