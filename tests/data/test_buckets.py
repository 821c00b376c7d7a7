"""Static-shape buckets: exact values at and around the bucket edges."""

from __future__ import annotations

from jaxvrl.data.buckets import length_bucket, pow2_bucket


def test_length_bucket_rounds_up_to_a_whole_step():
    want = {0: 32, 1: 32, 32: 32, 33: 64, 64: 64, 65: 96}
    assert {n: length_bucket(n, 32) for n in want} == want


def test_pow2_bucket_rounds_up_to_a_power_of_two_at_least_minimum():
    want = {0: 0, 1: 1, 2: 2, 3: 4, 5: 8, 1024: 1024, 1025: 2048}
    assert {n: pow2_bucket(n) for n in want} == want
    want = {0: 0, 1: 16, 16: 16, 17: 32}  # 0 stays 0: no vision input at all
    assert {n: pow2_bucket(n, 16) for n in want} == want
