"""Tolerances for reductions that hold on any x86 machine.

float32 sums are rounded differently from one processor, XLA version or reduction order to
the next: the error of a sum is a small multiple of eps times the sum of the terms' magnitudes,
not of the sum itself. A mean of terms that cancel (advantages around their group mean, a
policy loss of positive and negative advantages) can be far smaller than its terms, so a
tolerance relative to the result fails on another machine. These helpers scale the absolute
tolerance to the terms that were reduced.
"""

from __future__ import annotations

import numpy as np


def term_scale(terms, mask=None) -> float:
    """Mean |term| over the entries a reduction summed (mask > 0 where given)."""
    terms = np.abs(np.asarray(terms, np.float64))
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask) > 0, terms.shape)
        terms = terms[mask]
    return float(terms.mean()) if terms.size else 0.0


def assert_reduction_close(actual, desired, scale: float, rtol: float = 1e-5, err_msg=""):
    """actual ~ desired for means (or normalised sums) of terms whose mean magnitude is
    `scale`: |actual - desired| <= rtol * (|desired| + scale)."""
    np.testing.assert_allclose(
        np.asarray(actual, np.float64),
        np.asarray(desired, np.float64),
        rtol=rtol,
        atol=rtol * scale,
        err_msg=err_msg,
    )
