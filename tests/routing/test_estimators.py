"""The extension's ``ResistantLine`` against the same algorithm written in Python (the
work model's estimator before it moved into the extension): the same fit to the bit on
random samples, whatever their sizes, order, window and outliers."""

from __future__ import annotations

import math
from collections import deque
from statistics import median

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.routing.load import ResistantLine


class ReferenceLine:
    """The algorithm as ``kvroute.routing.load.estimators`` documents it, in Python."""

    def __init__(self, slope: float, intercept: float, window: int, min_samples: int) -> None:
        self.slope, self.intercept = slope, intercept
        self.prior = (intercept, slope)
        self.window, self.min_samples = window, min_samples
        self.by_size: dict[int, deque[tuple[float, float]]] = {}

    def observe(self, x: float, y: float) -> None:
        if not (x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)):
            return
        bucket = self.by_size.setdefault(int(x).bit_length(), deque(maxlen=self.window))
        bucket.append((x, y))
        pts = [p for b in self.by_size.values() for p in b]
        if len(pts) < self.min_samples:
            return
        groups = sorted(
            (median(p[0] for p in b), median(p[1] for p in b)) for b in self.by_size.values()
        )
        slopes = [
            (y2 - y1) / (x2 - x1)
            for i, (x1, y1) in enumerate(groups)
            for x2, y2 in groups[i + 1 :]
            if x2 > 1.5 * x1
        ]
        fit = median(slopes) if slopes else 0.0
        if fit > 0:
            slope = fit
            intercept = median(y - slope * x for x, y in pts)
            if intercept < -1e-6:
                slope = median(y / x for x, y in pts)
            intercept = max(0.0, intercept)
        else:
            k = median(y / (self.prior[0] + self.prior[1] * x) for x, y in pts)
            intercept, slope = k * self.prior[0], k * self.prior[1]
        self.slope, self.intercept = slope, intercept

    @property
    def samples(self) -> int:
        return sum(len(b) for b in self.by_size.values())


# Sizes from below one token to a million, seconds with a line, noise and outliers, and
# some samples the estimator must ignore.
_sample = st.one_of(
    st.tuples(
        st.floats(0.1, 1e6, allow_nan=False),
        st.floats(1e-6, 100.0, allow_nan=False),
    ),
    st.tuples(
        st.integers(1, 200_000).map(float),
        st.floats(0.001, 2.0, allow_nan=False),
    ),
    st.sampled_from([(0.0, 1.0), (5.0, 0.0), (-3.0, 1.0), (math.inf, 1.0), (5.0, math.nan)]),
)


@settings(max_examples=400, deadline=None)
@given(
    samples=st.lists(_sample, max_size=200),
    prior=st.tuples(st.floats(0.0, 1.0), st.floats(1e-9, 1e-2)),
    window=st.integers(1, 20),
    min_samples=st.integers(1, 5),
)
def test_the_native_line_fits_as_the_python_algorithm_to_the_bit(
    samples: list[tuple[float, float]],
    prior: tuple[float, float],
    window: int,
    min_samples: int,
) -> None:
    intercept, slope = prior
    native = ResistantLine(slope, intercept, window=window, min_samples=min_samples)
    ref = ReferenceLine(slope, intercept, window, min_samples)
    assert native.prior == ref.prior
    for x, y in samples:
        native.observe(x, y)
        ref.observe(x, y)
        # Bit for bit (float == would take -0.0 for 0.0).
        assert native.intercept.hex() == ref.intercept.hex()
        assert native.slope.hex() == ref.slope.hex()
        assert native.samples == ref.samples
        # What the work model reads: the fit once it has enough samples, else None.
        learned = native.learned
        if ref.samples >= min_samples:
            assert learned is not None
            assert (learned[0].hex(), learned[1].hex()) == (ref.intercept.hex(), ref.slope.hex())
        else:
            assert learned is None
    counts = {size: len(b) for size, b in ref.by_size.items() if b}
    assert dict(native.class_counts()) == counts


def test_a_line_of_linear_samples_over_many_sizes_is_recovered() -> None:
    native = ResistantLine(1 / 15_000, 0.01)
    for i in range(400):
        x = 50 * 1.7 ** (i % 12)
        native.observe(x, 0.02 + x / 8_000)
    assert native.slope == pytest.approx(1 / 8_000)
    assert native.intercept == pytest.approx(0.02)
    classes = {int(50 * 1.7**k).bit_length() for k in range(12)}
    assert native.samples == 16 * len(classes)  # the window per size class


def test_window_and_min_samples_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ResistantLine(1.0, window=0)
    with pytest.raises(ValueError, match="at least 1"):
        ResistantLine(1.0, min_samples=0)
