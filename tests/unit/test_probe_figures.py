"""The probe's link figures: the optimistic end is never slower than the typical one."""
from __future__ import annotations

import pytest

from sparkdl.driver.probe import link_figures


def test_best_link_is_at_least_the_typical_one_when_load_hit_the_small_messages() -> None:
    # small pings mostly delayed by load (median 0.8 ms), the large messages not
    small = [0.00005, 0.0008, 0.0008, 0.0009, 0.0008]
    large = [0.0011, 0.0012, 0.0013, 0.0012, 0.0011]
    (latency, bandwidth), (best_latency, best_bandwidth) = link_figures(small, large, 4 << 20)
    assert best_latency <= latency and best_bandwidth >= bandwidth
    assert latency == pytest.approx(0.0008) and best_latency == pytest.approx(0.00005)


def test_quiet_link_figures_follow_the_measurements() -> None:
    small, large = [1e-4] * 3, [1.1e-3, 1.1e-3, 1.0e-3]
    (latency, bandwidth), (best_latency, best_bandwidth) = link_figures(small, large, 1_000_000)
    assert bandwidth == pytest.approx(1_000_000 / 1.0e-3)
    assert best_bandwidth == pytest.approx(1_000_000 / 0.9e-3)
