//! The timing harness of `rtrun microbenchmark`, measuring the way Ray's `ray microbenchmark`
//! does (`ray_microbenchmark_helpers.timeit`): warm up for one second, then four rounds of two
//! seconds, each round running the operation in steps; the rate of each round is
//! `multiplier × operations / seconds`, printed as `<name> per second <mean> +- <sd>`.

use std::time::{Duration, Instant};

/// Timing settings (Ray's values by default).
#[derive(Debug, Clone)]
pub struct TimingConfig {
    /// Warm-up duration.
    pub warmup: Duration,
    /// Duration of each measured round.
    pub round: Duration,
    /// Number of measured rounds.
    pub rounds: usize,
}

impl Default for TimingConfig {
    fn default() -> Self {
        TimingConfig { warmup: Duration::from_secs(1), round: Duration::from_secs(2), rounds: 4 }
    }
}

/// The measured rate of one metric.
#[derive(Debug, Clone)]
pub struct Measurement {
    /// Ray's metric name.
    pub name: String,
    /// Mean rate per second over the rounds.
    pub mean: f64,
    /// Population standard deviation of the round rates.
    pub sd: f64,
}

impl std::fmt::Display for Measurement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} per second {:.2} +- {:.2}", self.name, self.mean, self.sd)
    }
}

/// Times `op` as Ray's `timeit` does; `multiplier` is the number of operations one call counts
/// for (1,000 for a batch of 1,000 calls, 0.8 for one 800 MB put in gigabytes).
pub fn timeit(
    name: &str,
    config: &TimingConfig,
    multiplier: f64,
    mut op: impl FnMut() -> crate::Result<()>,
) -> crate::Result<Measurement> {
    let start = Instant::now();
    let mut count: u64 = 0;
    while start.elapsed() < config.warmup {
        op()?;
        count += 1;
    }
    let step = count / 10 + 1;
    let mut rates = Vec::with_capacity(config.rounds);
    for _ in 0..config.rounds {
        let start = Instant::now();
        let mut done: u64 = 0;
        while start.elapsed() < config.round {
            for _ in 0..step {
                op()?;
            }
            done += step;
        }
        rates.push(multiplier * done as f64 / start.elapsed().as_secs_f64());
    }
    let mean = rates.iter().sum::<f64>() / rates.len().max(1) as f64;
    let var = rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / rates.len().max(1) as f64;
    Ok(Measurement { name: name.to_owned(), mean, sd: var.sqrt() })
}
