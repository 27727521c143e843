"""Robust online estimators of the work model (``kvroute.routing.load``): a line fitted
to (size, seconds) samples, and a windowed median. Bounded memory, priors before data."""

from __future__ import annotations

import math
from collections import deque
from statistics import median

WINDOW = 16
MIN_SAMPLES = 3


class ResistantLine:
    """``y = intercept + slope * x`` fitted robustly to the last ``window`` samples of each
    size class (``x`` within a factor of 2; bounded: at most ~32 classes). Each class is
    summed up by its medians; the slope is the median of the slopes between every two
    classes (a Theil-Sen estimator on class medians), the intercept the median residual
    of all samples. A few wild samples (a stall, a slot wait) move neither. Classes less
    than 1.5x apart are not paired; with no pair (the sizes seen are too alike to tell
    slope from intercept) the prior line is scaled
    as a whole to the samples (median ratio). An intercept that would go negative by
    more than rounding gives a line through the origin instead. Before ``min_samples``
    samples: the prior. Refitted at each sample, O(window log window)."""

    __slots__ = ("_by_size", "_count", "intercept", "min_samples", "prior", "slope", "window")

    def __init__(
        self,
        slope: float,
        intercept: float = 0.0,
        window: int = WINDOW,
        min_samples: int = MIN_SAMPLES,
    ) -> None:
        self.slope = slope
        self.intercept = intercept
        self.prior = (intercept, slope)
        self.min_samples = min_samples
        self.window = window
        # The last ``window`` samples of each size class (x within a factor 2): a burst
        # of one size (cache hits under load) must not push out what other sizes taught.
        self._by_size: dict[int, deque[tuple[float, float]]] = {}
        self._count = 0  # samples held (read at every prediction: kept, not summed)

    def observe(self, x: float, y: float) -> None:
        if not (x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)):
            return
        size = int(x).bit_length()
        bucket = self._by_size.get(size)
        if bucket is None:
            bucket = self._by_size[size] = deque(maxlen=self.window)
        if len(bucket) < self.window:
            self._count += 1
        bucket.append((x, y))
        pts = sorted(p for b in self._by_size.values() for p in b)
        n = len(pts)
        if n < self.min_samples:
            return
        groups = sorted(
            (median(p[0] for p in b), median(p[1] for p in b)) for b in self._by_size.values()
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
            if intercept < -1e-6:  # too steep for what is seen: through the origin
                slope = median(y / x for x, y in pts)
            intercept = max(0.0, intercept)
        else:
            # The sizes seen are too alike to split slope from intercept: scale the
            # prior line as a whole (a 5x slower worker is 5x slower at any size).
            k = median(y / (self.prior[0] + self.prior[1] * x) for x, y in pts)
            intercept, slope = k * self.prior[0], k * self.prior[1]
        self.slope, self.intercept = slope, intercept

    @property
    def samples(self) -> int:
        return self._count


class MedianEstimator:
    """Median of the last ``window`` samples; ``prior`` until ``min_samples`` came."""

    __slots__ = ("_samples", "_value", "min_samples", "prior")

    def __init__(self, prior: float, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self.prior = prior
        self.min_samples = min_samples
        self._samples: deque[float] = deque(maxlen=window)
        self._value = prior

    def observe(self, x: float) -> None:
        if x > 0 and x == x and x != float("inf"):
            self._samples.append(x)
            if len(self._samples) >= self.min_samples:
                self._value = median(self._samples)

    @property
    def value(self) -> float:
        return self._value

    @property
    def samples(self) -> int:
        return len(self._samples)
