//! Reward shaping before advantages: DAPO's soft overlong penalty and a running reward
//! normalisation. Plain numbers, no tensors: one scalar reward per sequence.

use serde::{Deserialize, Serialize};

/// DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 while a response of `length`
/// tokens stays within `max_len − buffer_len`, then falling linearly to `−factor` at
/// `max_len` (and below it past `max_len`, should a response get there).
pub fn overlong_penalty(length: usize, max_len: usize, buffer_len: usize, factor: f64) -> f64 {
    let start = max_len.saturating_sub(buffer_len);
    if length <= start || buffer_len == 0 {
        return 0.0;
    }
    -factor * (length - start) as f64 / buffer_len as f64
}

/// The count, mean and sum of squared deviations of every reward seen so far (merged batch by
/// batch with Chan et al.'s parallel update, exact in any grouping).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct RunningMoments {
    /// Rewards seen.
    pub count: f64,
    /// Their mean.
    pub mean: f64,
    /// Σ (x − mean)².
    pub m2: f64,
}

/// The `ε` added to the standard deviation a reward is divided by.
pub const REWARD_NORM_EPS: f64 = 1e-8;

impl RunningMoments {
    /// The moments of `values`.
    pub fn of(values: &[f32]) -> Self {
        let count = values.len() as f64;
        if values.is_empty() {
            return Self::default();
        }
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / count;
        let m2 = values.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum();
        Self { count, mean, m2 }
    }

    /// The moments of both sets together.
    pub fn merge(&self, other: &Self) -> Self {
        let count = self.count + other.count;
        if count == 0.0 {
            return Self::default();
        }
        let delta = other.mean - self.mean;
        Self {
            count,
            mean: self.mean + delta * other.count / count,
            m2: self.m2 + other.m2 + delta * delta * self.count * other.count / count,
        }
    }

    /// The population standard deviation.
    pub fn std(&self) -> f64 {
        if self.count > 0.0 { (self.m2 / self.count).sqrt() } else { 0.0 }
    }

    /// `(x − mean) / (std + ε)`.
    pub fn normalize(&self, x: f32) -> f32 {
        ((f64::from(x) - self.mean) / (self.std() + REWARD_NORM_EPS)) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_penalty_by_hand() {
        // max 100, buffer 20, factor 1: free up to 80, then −(len − 80)/20.
        assert_eq!(overlong_penalty(80, 100, 20, 1.0), 0.0);
        assert_eq!(overlong_penalty(10, 100, 20, 1.0), 0.0);
        assert!((overlong_penalty(90, 100, 20, 1.0) + 0.5).abs() < 1e-12);
        assert!((overlong_penalty(100, 100, 20, 1.0) + 1.0).abs() < 1e-12);
        assert!((overlong_penalty(95, 100, 20, 0.5) + 0.375).abs() < 1e-12);
        assert_eq!(overlong_penalty(100, 100, 0, 1.0), 0.0);
    }

    #[test]
    fn moments_merge_exactly_and_normalise_by_hand() {
        // {1, 2, 3, 4}: mean 2.5, m2 = 2.25 + 0.25 + 0.25 + 2.25 = 5, std √(5/4) = 1.1180340.
        let all = RunningMoments::of(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!((all.count, all.mean, all.m2), (4.0, 2.5, 5.0));
        let merged = RunningMoments::of(&[1.0]).merge(&RunningMoments::of(&[2.0, 3.0, 4.0]));
        assert!((merged.mean - 2.5).abs() < 1e-12 && (merged.m2 - 5.0).abs() < 1e-12);
        let empty = RunningMoments::default().merge(&all);
        assert_eq!(empty, all);
        // 4 → (4 − 2.5)/1.1180340 = 1.3416408.
        assert!((all.normalize(4.0) - 1.341_640_8).abs() < 1e-6);
        assert_eq!(RunningMoments::of(&[]), RunningMoments::default());
    }
}
