//! A line `y = intercept + slope * x` fitted robustly to (size, seconds) samples: the work
//! model's learned prefill speed (x: uncached tokens) and decode step (x: batch size) per
//! worker (`kvroute.routing.load`).
//!
//! The samples are kept per *size class* (`x` within a factor of 2: the bit length of its
//! integer part), the last `window` of each, so that a burst of one size (cache hits under
//! load) does not push out what other sizes taught. At every sample the line is refitted:
//!
//! * each class is summed up by its medians (of x, of y), and the classes sorted;
//! * the slope is the median of the slopes between every two classes at least 1.5x apart
//!   (a Theil-Sen estimator on class medians), the intercept the median residual
//!   `y - slope * x` of all samples. A few wild samples (a stall, a slot wait) move
//!   neither. An intercept below -1e-6 (too steep for what is seen) gives a line through
//!   the origin instead, its slope the median of `y / x`;
//! * with no pair of classes, or a slope that is not positive (the sizes seen are too
//!   alike to tell slope from intercept), the prior line is scaled as a whole to the
//!   samples: by the median of `y / prior(x)` (a 5x slower worker is 5x slower at any
//!   size).
//!
//! Before `min_samples` samples the prior holds. A median of an even count is the mean of
//! the two middle values, computed as `(a + b) / 2`, so the fit is bit for bit what the
//! same algorithm in Python (`statistics.median`) gives; `tests/routing/test_estimators.py`
//! checks that on random samples. Memory is bounded: at most one class per bit length of
//! `x` (about 64), `window` samples each. The refit selects the medians it needs instead
//! of sorting: 1-4 µs per sample with one to ten classes, where the same fit in Python
//! took 15-62 µs on the request path of every streamed answer.

use std::collections::VecDeque;

/// The fitted line and its samples.
#[derive(Clone, Debug)]
pub struct ResistantLine {
    pub slope: f64,
    pub intercept: f64,
    prior: (f64, f64),
    window: usize,
    min_samples: usize,
    /// (class, its last `window` samples), in the order the classes were first seen.
    classes: Vec<(u32, VecDeque<(f64, f64)>)>,
    count: usize,
    scratch: Vec<f64>,
}

/// The class of `x` (> 0, finite): the bit length of its integer part, 0 below 1.
pub fn size_class(x: f64) -> u32 {
    if x < 1.0 {
        return 0;
    }
    // For x >= 1 the integer part lies in [2^e, 2^(e+1)) with e the binary exponent.
    let exponent = ((x.to_bits() >> 52) & 0x7ff) as u32;
    exponent - 1023 + 1
}

/// The median of `v` (not empty), reordering it: the middle value, or the mean of the
/// two middle ones.
pub fn median(v: &mut [f64]) -> f64 {
    let n = v.len();
    let i = n / 2;
    let (left, mid, _) = v.select_nth_unstable_by(i, f64::total_cmp);
    let upper = *mid;
    if n % 2 == 1 {
        return upper;
    }
    let lower = left.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lower + upper) / 2.0
}

impl ResistantLine {
    /// `window` >= 1 and `min_samples` >= 1 (the binding checks).
    pub fn new(slope: f64, intercept: f64, window: usize, min_samples: usize) -> Self {
        ResistantLine {
            slope,
            intercept,
            prior: (intercept, slope),
            window,
            min_samples,
            classes: Vec::new(),
            count: 0,
            scratch: Vec::new(),
        }
    }

    /// (intercept, slope) before any sample.
    pub fn prior(&self) -> (f64, f64) {
        self.prior
    }

    pub fn window(&self) -> usize {
        self.window
    }

    pub fn min_samples(&self) -> usize {
        self.min_samples
    }

    /// Samples held (at most `window` per class).
    pub fn samples(&self) -> usize {
        self.count
    }

    /// Each class's samples held, by class.
    pub fn class_counts(&self) -> Vec<(u32, usize)> {
        let mut out: Vec<(u32, usize)> = self.classes.iter().map(|(c, b)| (*c, b.len())).collect();
        out.sort_unstable();
        out
    }

    /// Add a sample and refit; samples that are not positive and finite are ignored.
    pub fn observe(&mut self, x: f64, y: f64) {
        if !(x > 0.0 && y > 0.0 && x.is_finite() && y.is_finite()) {
            return;
        }
        let class = size_class(x);
        let at = match self.classes.iter().position(|(c, _)| *c == class) {
            Some(at) => at,
            None => {
                self.classes
                    .push((class, VecDeque::with_capacity(self.window)));
                self.classes.len() - 1
            }
        };
        let bucket = &mut self.classes[at].1;
        if bucket.len() < self.window {
            self.count += 1;
        } else {
            bucket.pop_front();
        }
        bucket.push_back((x, y));
        if self.count < self.min_samples {
            return;
        }
        self.refit();
    }

    fn refit(&mut self) {
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut groups: Vec<(f64, f64)> = Vec::with_capacity(self.classes.len());
        for (_, bucket) in &self.classes {
            scratch.clear();
            scratch.extend(bucket.iter().map(|p| p.0));
            let mx = median(&mut scratch);
            scratch.clear();
            scratch.extend(bucket.iter().map(|p| p.1));
            groups.push((mx, median(&mut scratch)));
        }
        groups.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        scratch.clear();
        for (i, &(x1, y1)) in groups.iter().enumerate() {
            for &(x2, y2) in &groups[i + 1..] {
                if x2 > 1.5 * x1 {
                    scratch.push((y2 - y1) / (x2 - x1));
                }
            }
        }
        let fit = if scratch.is_empty() {
            0.0
        } else {
            median(&mut scratch)
        };
        let points = || self.classes.iter().flat_map(|(_, b)| b.iter().copied());
        if fit > 0.0 {
            let mut slope = fit;
            scratch.clear();
            scratch.extend(points().map(|(x, y)| y - slope * x));
            let intercept = median(&mut scratch);
            if intercept < -1e-6 {
                scratch.clear();
                scratch.extend(points().map(|(x, y)| y / x));
                slope = median(&mut scratch);
            }
            self.slope = slope;
            // Python's max(0.0, intercept): 0.0 unless above it (-0.0 and NaN too).
            self.intercept = if intercept > 0.0 { intercept } else { 0.0 };
        } else {
            let (p0, p1) = self.prior;
            scratch.clear();
            scratch.extend(points().map(|(x, y)| y / (p0 + p1 * x)));
            let k = median(&mut scratch);
            self.intercept = k * p0;
            self.slope = k * p1;
        }
        self.scratch = scratch;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_bit_lengths() {
        assert_eq!(size_class(0.5), 0);
        assert_eq!(size_class(1.0), 1);
        assert_eq!(size_class(1.99), 1);
        assert_eq!(size_class(2.0), 2);
        assert_eq!(size_class(1023.9), 10);
        assert_eq!(size_class(1024.0), 11);
        assert_eq!(size_class(1e300), 997);
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut [7.0]), 7.0);
    }

    #[test]
    fn recovers_a_line_from_two_sizes() {
        let mut line = ResistantLine::new(1.0, 0.0, 16, 3);
        for _ in 0..8 {
            line.observe(100.0, 0.01 + 100.0 * 1e-4);
            line.observe(1000.0, 0.01 + 1000.0 * 1e-4);
        }
        assert!((line.slope - 1e-4).abs() < 1e-12);
        assert!((line.intercept - 0.01).abs() < 1e-12);
    }

    #[test]
    fn one_size_scales_the_prior() {
        let mut line = ResistantLine::new(1e-4, 0.01, 16, 3);
        for _ in 0..5 {
            line.observe(1000.0, 2.0 * (0.01 + 1000.0 * 1e-4));
        }
        assert!((line.slope - 2e-4).abs() < 1e-15);
        assert!((line.intercept - 0.02).abs() < 1e-15);
    }

    #[test]
    fn the_prior_holds_until_min_samples() {
        let mut line = ResistantLine::new(1e-4, 0.01, 16, 3);
        line.observe(100.0, 5.0);
        line.observe(1000.0, 5.0);
        assert_eq!((line.intercept, line.slope), (0.01, 1e-4));
        assert_eq!(line.samples(), 2);
    }

    #[test]
    fn a_class_keeps_its_last_window() {
        let mut line = ResistantLine::new(1e-4, 0.01, 4, 3);
        for i in 0..10 {
            line.observe(100.0 + f64::from(i), 0.1);
        }
        line.observe(5000.0, 1.0);
        assert_eq!(line.samples(), 5);
        assert_eq!(line.class_counts(), vec![(7, 4), (13, 1)]);
    }

    #[test]
    fn bad_samples_are_ignored() {
        let mut line = ResistantLine::new(1e-4, 0.01, 16, 1);
        for (x, y) in [
            (0.0, 1.0),
            (1.0, 0.0),
            (f64::NAN, 1.0),
            (1.0, f64::INFINITY),
            (-1.0, 1.0),
        ] {
            line.observe(x, y);
        }
        assert_eq!(line.samples(), 0);
        assert_eq!((line.intercept, line.slope), (0.01, 1e-4));
    }
}
