"""``metrics.observe_many`` counts a batch exactly as ``observe`` of each would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from spokefs import metrics

_BOUNDS = (0.001, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples
            if not s.name.endswith("_created")]


@pytest.mark.parametrize("amounts", [
    [],
    [0.5, 2.0],  # fewer than the batch path takes
    [0.0, 0.001, 0.001, 0.0100001, 0.1, 1.0, 1.5, 1e9, -1.0],  # on and around the bounds
    [random.Random(7).lognormvariate(-6, 2) for _ in range(500)],
])
def test_observe_many_matches_observe(amounts: list[float]) -> None:
    one, many = CollectorRegistry(), CollectorRegistry()
    each = Histogram("h", "h", buckets=_BOUNDS, registry=one)
    batched = Histogram("h", "h", buckets=_BOUNDS, registry=many)
    for amount in amounts:
        each.observe(amount)
    metrics.observe_many(batched, amounts)
    assert _close(_samples(many), _samples(one))


def _close(a: list[tuple[str, dict[str, str], float]],
           b: list[tuple[str, dict[str, str], float]]) -> bool:
    """Equal, the sums within float rounding (one addition to the sum, not many)."""
    return len(a) == len(b) and all(
        x[:2] == y[:2] and x[2] == pytest.approx(y[2], rel=1e-12)
        for x, y in zip(a, b, strict=True))
