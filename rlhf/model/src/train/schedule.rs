//! The learning-rate schedule: linear warm-up, then cosine decay to a floor (the schedule
//! OpenRLHF and verl use by default, `cosine_with_min_lr`).

use serde::{Deserialize, Serialize};

/// Warm-up + cosine schedule settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleConfig {
    /// Peak learning rate, reached at the end of warm-up. Default 1e-5.
    pub peak_lr: f64,
    /// Optimizer steps of linear warm-up from 0. Default 0.
    pub warmup_steps: u64,
    /// Total optimizer steps; after it the rate stays at the floor. Default 1000.
    pub total_steps: u64,
    /// The floor as a fraction of the peak. Default 0.1 (OpenRLHF's `min_lr = 0.1 * lr`).
    pub min_lr_ratio: f64,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self { peak_lr: 1e-5, warmup_steps: 0, total_steps: 1000, min_lr_ratio: 0.1 }
    }
}

impl ScheduleConfig {
    /// The learning rate of optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.peak_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let floor = self.peak_lr * self.min_lr_ratio;
        let decay_steps = self.total_steps.saturating_sub(self.warmup_steps);
        if decay_steps == 0 {
            return self.peak_lr;
        }
        let progress = ((step - self.warmup_steps) as f64 / decay_steps as f64).min(1.0);
        floor + (self.peak_lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn lr_stays_between_zero_and_peak_and_decays_after_warmup(
            warmup in 0u64..50, total in 1u64..500, ratio in 0.0f64..1.0, step in 0u64..1000,
        ) {
            let s = ScheduleConfig { peak_lr: 1e-3, warmup_steps: warmup, total_steps: total, min_lr_ratio: ratio };
            let lr = s.lr_at(step);
            prop_assert!(lr > 0.0 || ratio == 0.0);
            prop_assert!(lr <= 1e-3 + 1e-15);
            if step >= warmup {
                prop_assert!(s.lr_at(step + 1) <= lr + 1e-15);
            } else {
                prop_assert!(s.lr_at(step + 1) >= lr - 1e-15);
            }
        }
    }

    #[test]
    fn schedule_hits_peak_then_floor() {
        let s =
            ScheduleConfig { peak_lr: 1.0, warmup_steps: 10, total_steps: 110, min_lr_ratio: 0.1 };
        assert!((s.lr_at(0) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(9) - 1.0).abs() < 1e-12);
        assert!((s.lr_at(10) - 1.0).abs() < 1e-12);
        assert!((s.lr_at(60) - 0.55).abs() < 1e-12);
        assert!((s.lr_at(110) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(10_000) - 0.1).abs() < 1e-12);
    }
}
