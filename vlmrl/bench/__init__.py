"""Benchmarks (`make bench`): results land in bench/results/ with the command that made them."""

from pathlib import Path


def report(text: str, out: str | None) -> int:
    """Print a bench's markdown `text` and, with `out`, write it to that file too; returns 0."""
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0
