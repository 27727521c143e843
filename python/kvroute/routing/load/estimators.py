"""Robust online estimators of the work model (``kvroute.routing.load``): a line fitted
to (size, seconds) samples, and a windowed median. Bounded memory, priors before data.

``ResistantLine`` is the extension's (``rust/src/estimators.rs``): ``y = intercept +
slope * x`` fitted robustly to the last ``window`` samples of each size class (``x``
within a factor of 2; at most one class per bit length of ``x``). Each class is summed
up by its medians; the slope is the median of the slopes between every two classes at
least 1.5x apart (a Theil-Sen estimator on class medians), the intercept the median
residual of all samples. A few wild samples (a stall, a slot wait) move neither. With
no such pair (the sizes seen are too alike to tell slope from intercept) the prior line
is scaled as a whole to the samples (median ratio). An intercept that would go negative
by more than rounding gives a line through the origin instead. Before ``min_samples``
samples: the prior. Refitted at each sample, which every streamed answer gives its
worker: in Python the refit cost 15 µs with one size class and 62 µs with ten (prompts
from tens to tens of thousands of uncached tokens), in the extension 1-4 µs; the fit is
the same to the bit (``tests/routing/test_estimators.py``;
``docs/studies/router-overhead.md``).
"""

from __future__ import annotations

from collections import deque
from statistics import median

from kvroute._native import ResistantLine

__all__ = ["MIN_SAMPLES", "WINDOW", "MedianEstimator", "ResistantLine"]

WINDOW = 16
MIN_SAMPLES = 3


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
