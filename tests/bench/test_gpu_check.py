"""The GPU check's pure parts, on the CPU: the device-busy share of a run's kernel intervals."""

from __future__ import annotations

import pytest

from bench.gpu_check import busy_share


def test_busy_share_is_the_union_over_the_span():
    assert busy_share([]) == 0.0
    assert busy_share([(0.0, 10.0)]) == 1.0
    # back to back, overlapping (two streams), nested: no idle time
    assert busy_share([(0, 4), (4, 6), (5, 10), (6, 7)]) == 1.0
    # idle 4-6 and 8-10 of 0-12; unsorted, and a kernel that ends last but starts early
    assert busy_share([(10, 12), (0, 4), (6, 8), (1, 3)]) == pytest.approx(8 / 12)
    assert busy_share([(0, 1), (2, 20), (3, 4)]) == pytest.approx(19 / 20)
