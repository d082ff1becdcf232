//! Named phase timings: within a step the driver times its phases (generate, reward, reference,
//! train, weight sync, ...), then closes the step; the timer hands back that step's timings and
//! accumulates totals for the end-of-run summary.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Times the phases of each step and accumulates them over the run.
///
/// Phases may overlap (e.g. actor and critic training run concurrently); each is timed on its
/// own, so the per-step sum can exceed the step's wall time.
#[derive(Debug, Default, Clone)]
pub struct PhaseTimer {
    /// Phases of the open step, in first-seen order.
    current: Vec<(String, Duration)>,
    /// Totals of closed steps, in first-seen order.
    totals: Vec<PhaseTotal>,
    /// Number of closed steps.
    steps: u64,
}

/// A started phase; hand it back to [`PhaseTimer::stop`].
#[must_use = "a phase is only recorded when it is passed to PhaseTimer::stop"]
#[derive(Debug)]
pub struct PhaseStart {
    name: String,
    started: Instant,
}

/// The timings of one step, in the order the phases first ran.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPhases {
    /// `(phase, time spent in it during the step)`.
    pub phases: Vec<(String, Duration)>,
}

/// A phase's accumulated time over the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseTotal {
    /// The phase name.
    pub name: String,
    /// Time summed over all steps.
    pub total: Duration,
    /// Number of steps in which the phase ran.
    pub steps: u64,
    /// The longest time of the phase in one step.
    pub max: Duration,
}

impl PhaseTotal {
    /// Mean time per step in which the phase ran.
    pub fn mean(&self) -> Duration {
        if self.steps == 0 { Duration::ZERO } else { self.total.div_f64(self.steps as f64) }
    }
}

impl PhaseTimer {
    /// An empty timer.
    pub fn new() -> Self {
        Self::default()
    }

    /// A timer that continues from totals saved in a checkpoint (see [`PhaseTimer::totals`]).
    pub fn resume(totals: Vec<PhaseTotal>, steps: u64) -> Self {
        Self { current: Vec::new(), totals, steps }
    }

    /// Starts timing `name`.
    pub fn start(&self, name: impl Into<String>) -> PhaseStart {
        PhaseStart { name: name.into(), started: Instant::now() }
    }

    /// Stops a phase and adds its time to the open step; returns the time.
    pub fn stop(&mut self, phase: PhaseStart) -> Duration {
        let elapsed = phase.started.elapsed();
        self.record(phase.name, elapsed);
        elapsed
    }

    /// Runs `body` as phase `name`.
    pub fn time<T>(&mut self, name: impl Into<String>, body: impl FnOnce() -> T) -> T {
        let phase = self.start(name);
        let result = body();
        self.stop(phase);
        result
    }

    /// Adds `duration` to phase `name` of the open step (a phase measured elsewhere, e.g. by a
    /// remote actor). A phase that runs several times in a step accumulates.
    pub fn record(&mut self, name: impl Into<String>, duration: Duration) {
        let name = name.into();
        match self.current.iter_mut().find(|(existing, _)| *existing == name) {
            Some(slot) => slot.1 += duration,
            None => self.current.push((name, duration)),
        }
    }

    /// The phases recorded so far in the open step.
    pub fn current_step(&self) -> &[(String, Duration)] {
        &self.current
    }

    /// Closes the open step: returns its timings and adds them to the totals.
    pub fn finish_step(&mut self) -> StepPhases {
        let phases = std::mem::take(&mut self.current);
        for (name, duration) in &phases {
            match self.totals.iter_mut().find(|total| total.name == *name) {
                Some(total) => {
                    total.total += *duration;
                    total.steps += 1;
                    total.max = total.max.max(*duration);
                }
                None => self.totals.push(PhaseTotal {
                    name: name.clone(),
                    total: *duration,
                    steps: 1,
                    max: *duration,
                }),
            }
        }
        self.steps += 1;
        StepPhases { phases }
    }

    /// Totals over closed steps, in the order phases first ran.
    pub fn totals(&self) -> &[PhaseTotal] {
        &self.totals
    }

    /// Number of closed steps.
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

impl StepPhases {
    /// The step's phases in seconds, e.g. for [`crate::StepMetrics::extend_prefixed`] with
    /// prefix `"time/"`.
    pub fn seconds(&self) -> impl Iterator<Item = (&str, f64)> + '_ {
        self.phases.iter().map(|(name, duration)| (name.as_str(), duration.as_secs_f64()))
    }

    /// The sum of the step's phase times.
    pub fn sum(&self) -> Duration {
        self.phases.iter().map(|(_, duration)| *duration).sum()
    }

    /// A one-line rendering for progress output: `generate 1.20s  train 0.81s`.
    pub fn compact(&self) -> String {
        let parts: Vec<String> = self
            .phases
            .iter()
            .map(|(name, duration)| format!("{name} {}", format_seconds(*duration)))
            .collect();
        parts.join("  ")
    }
}

/// Formats a duration for humans with three significant digits: `0.042s`, `1.20s`, `12.3s`,
/// `2m05s`, `1h02m`.
pub fn format_seconds(duration: Duration) -> String {
    let seconds = duration.as_secs_f64();
    if seconds < 1.0 {
        format!("{seconds:.3}s")
    } else if seconds < 10.0 {
        format!("{seconds:.2}s")
    } else if seconds < 60.0 {
        format!("{seconds:.1}s")
    } else if seconds < 3600.0 {
        let whole = seconds.round() as u64;
        format!("{}m{:02}s", whole / 60, whole % 60)
    } else {
        let minutes = (seconds / 60.0).round() as u64;
        format!("{}h{:02}m", minutes / 60, minutes % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn accumulates_per_step_and_over_the_run() {
        let mut timer = PhaseTimer::new();
        timer.record("generate", 100 * MS);
        timer.record("train", 30 * MS);
        timer.record("generate", 20 * MS);
        let step = timer.finish_step();
        assert_eq!(step.phases, [("generate".to_owned(), 120 * MS), ("train".to_owned(), 30 * MS)]);
        assert_eq!(step.sum(), 150 * MS);
        assert_eq!(step.seconds().collect::<Vec<_>>(), [("generate", 0.12), ("train", 0.03)]);
        assert_eq!(step.compact(), "generate 0.120s  train 0.030s");
        assert!(timer.current_step().is_empty());

        timer.record("sync", 5 * MS);
        timer.record("generate", 80 * MS);
        timer.finish_step();
        let totals = timer.totals();
        assert_eq!(timer.steps(), 2);
        assert_eq!(
            totals.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            ["generate", "train", "sync"]
        );
        assert_eq!((totals[0].total, totals[0].steps, totals[0].max), (200 * MS, 2, 120 * MS));
        assert_eq!(totals[0].mean(), 100 * MS);
        assert_eq!((totals[2].total, totals[2].steps), (5 * MS, 1));

        let resumed = PhaseTimer::resume(totals.to_vec(), 2);
        assert_eq!(resumed.totals(), totals);
    }

    #[test]
    fn times_closures_and_started_phases() {
        let mut timer = PhaseTimer::new();
        let value = timer.time("compute", || (0..1000u64).sum::<u64>());
        assert_eq!(value, 499_500);
        let phase = timer.start("wait");
        let elapsed = timer.stop(phase);
        let names: Vec<_> = timer.current_step().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["compute", "wait"]);
        assert_eq!(timer.current_step()[1].1, elapsed);
    }

    #[test]
    fn formats_durations_readably() {
        assert_eq!(format_seconds(42 * MS), "0.042s");
        assert_eq!(format_seconds(1204 * MS), "1.20s");
        assert_eq!(format_seconds(Duration::from_secs_f64(12.34)), "12.3s");
        assert_eq!(format_seconds(Duration::from_secs(125)), "2m05s");
        assert_eq!(format_seconds(Duration::from_secs(3720)), "1h02m");
    }
}
