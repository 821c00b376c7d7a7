"""Static-shape buckets: how batch dimensions are rounded up so that a run compiles one program
per bucket rather than one per size."""

from __future__ import annotations


def length_bucket(n: int, step: int) -> int:
    """n rounded up to a multiple of `step`, at least one `step` (prompt lengths)."""
    return max(step, -(-n // step) * step)


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum); 0 stays 0 (no vision input at all)."""
    if n <= 0:
        return 0
    return max(minimum, 1 << (n - 1).bit_length())
