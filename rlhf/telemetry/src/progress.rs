//! The driver's live progress: an `indicatif` bar with the latest reward, KL and phase timings
//! when stderr is a terminal, and one plain log line per step (or every few steps) otherwise, so
//! CI logs and redirected output stay readable.

use std::io::{IsTerminal as _, Write};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::metrics::StepMetrics;
use crate::phase::{StepPhases, format_seconds};

/// The bar's layout: elapsed time, bar, position, ETA, the running phase (the prefix), then the
/// last step's fields and phase timings (the message).
const BAR_TEMPLATE: &str =
    "[{elapsed_precise}] {bar:20.cyan/blue} {pos}/{len} (eta {eta}) {prefix:.bold} ▸ {wide_msg}";

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// A bar if stderr is a terminal, lines otherwise.
    Auto,
    /// Always the bar (drawn on stderr).
    Bar,
    /// Plain lines on stderr.
    Lines,
    /// Nothing.
    Hidden,
}

/// A metric shown live: the label printed and the metric it reads from [`StepMetrics`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgressField {
    /// Printed label, e.g. `reward`.
    pub label: String,
    /// Metric name, e.g. `reward/mean`.
    pub metric: String,
}

impl ProgressField {
    /// Shows `metric` as `label`.
    pub fn new(label: impl Into<String>, metric: impl Into<String>) -> Self {
        Self { label: label.into(), metric: metric.into() }
    }
}

/// Options of [`RunProgress`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgressOptions {
    /// How to show progress. Default [`ProgressMode::Auto`].
    pub mode: ProgressMode,
    /// Metrics shown live, in order; missing ones are left out. Default `reward` and `kl`
    /// (OpenRLHF's names for the mean reward and the mean KL to the reference).
    pub fields: Vec<ProgressField>,
    /// In line mode, print every this many steps (the first and last step always print).
    /// Default 1.
    pub line_every_steps: u64,
    /// Steps already done when the run starts (a resumed run). Default 0.
    pub start_step: u64,
}

impl Default for ProgressOptions {
    fn default() -> Self {
        Self {
            mode: ProgressMode::Auto,
            fields: vec![ProgressField::new("reward", "reward"), ProgressField::new("kl", "kl")],
            line_every_steps: 1,
            start_step: 0,
        }
    }
}

enum Output {
    Bar(ProgressBar),
    Lines(Arc<Mutex<dyn Write + Send>>),
    Hidden,
}

/// Progress of a training run of `total_steps` steps, owned by the driver binary.
pub struct RunProgress {
    output: Output,
    options: ProgressOptions,
    total_steps: u64,
    started: Instant,
}

impl RunProgress {
    /// Starts progress output on stderr.
    pub fn new(total_steps: u64, options: ProgressOptions) -> Self {
        let mode = match options.mode {
            ProgressMode::Auto if std::io::stderr().is_terminal() => ProgressMode::Bar,
            ProgressMode::Auto => ProgressMode::Lines,
            other => other,
        };
        let output = match mode {
            ProgressMode::Bar => {
                let bar =
                    ProgressBar::with_draw_target(Some(total_steps), ProgressDrawTarget::stderr());
                let style = ProgressStyle::with_template(BAR_TEMPLATE)
                    .expect("BAR_TEMPLATE is a valid indicatif template")
                    .progress_chars("=> ");
                bar.set_style(style);
                bar.set_position(options.start_step);
                // Steps a resumed run starts with took no time here; keep them out of the ETA.
                bar.reset_eta();
                bar.enable_steady_tick(std::time::Duration::from_millis(250));
                Output::Bar(bar)
            }
            ProgressMode::Lines => Output::Lines(Arc::new(Mutex::new(std::io::stderr()))),
            ProgressMode::Hidden | ProgressMode::Auto => Output::Hidden,
        };
        Self { output, options, total_steps, started: Instant::now() }
    }

    /// Line-mode progress written to `writer` (tests, or a log file).
    pub fn with_writer(
        total_steps: u64,
        options: ProgressOptions,
        writer: Arc<Mutex<dyn Write + Send>>,
    ) -> Self {
        Self { output: Output::Lines(writer), options, total_steps, started: Instant::now() }
    }

    /// Shows which phase is running now (bar mode only: line mode prints per step).
    pub fn set_phase(&self, phase: &str) {
        if let Output::Bar(bar) = &self.output {
            bar.set_prefix(phase.to_owned());
        }
    }

    /// Reports a finished step: `metrics.step()` is the number of steps done (steps count
    /// from 1), `phases` its timings.
    pub fn step_done(&self, metrics: &StepMetrics, phases: &StepPhases) {
        let status = self.status_line(metrics, phases);
        match &self.output {
            Output::Bar(bar) => {
                bar.set_position(metrics.step());
                bar.set_message(status);
            }
            Output::Lines(writer) => {
                let step = metrics.step();
                let every = self.options.line_every_steps.max(1);
                let first = step == self.options.start_step + 1;
                if first || step.is_multiple_of(every) || step >= self.total_steps {
                    let line = format!(
                        "step {step}/{} [{}] {status}",
                        self.total_steps,
                        format_seconds(self.started.elapsed())
                    );
                    write_line(writer, &line);
                }
            }
            Output::Hidden => {}
        }
    }

    /// Prints a message above the bar, or as a line.
    pub fn println(&self, message: &str) {
        match &self.output {
            Output::Bar(bar) => bar.println(message),
            Output::Lines(writer) => write_line(writer, message),
            Output::Hidden => {}
        }
    }

    /// Ends the bar, leaving its last state on screen.
    pub fn finish(&self) {
        if let Output::Bar(bar) = &self.output {
            bar.finish();
        }
    }

    /// The live message: configured fields, then the step's phase timings.
    pub fn status_line(&self, metrics: &StepMetrics, phases: &StepPhases) -> String {
        let mut parts: Vec<String> = self
            .options
            .fields
            .iter()
            .filter_map(|field| {
                metrics
                    .get(&field.metric)
                    .map(|value| format!("{} {}", field.label, format_value(value)))
            })
            .collect();
        if !phases.phases.is_empty() {
            parts.push(format!("| {}", phases.compact()));
        }
        parts.join(" ")
    }
}

impl Drop for RunProgress {
    fn drop(&mut self) {
        if let Output::Bar(bar) = &self.output
            && !bar.is_finished()
        {
            bar.abandon();
        }
    }
}

/// Writes one line; progress output is best effort, so a closed stderr or a poisoned lock (a
/// panic while another thread printed) does not stop training.
fn write_line(writer: &Mutex<dyn Write + Send>, line: &str) {
    let mut guard = match writer.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    };
    let _ = writeln!(guard, "{line}");
    let _ = guard.flush();
}

/// Four significant digits, switching to scientific notation for very small or large values.
fn format_value(value: f64) -> String {
    let magnitude = value.abs();
    if value == 0.0 || (1e-3..1e5).contains(&magnitude) {
        let decimals =
            if magnitude >= 1.0 { 3usize.saturating_sub(magnitude.log10() as usize) } else { 4 };
        format!("{value:.decimals$}")
    } else {
        format!("{value:.3e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[derive(Clone, Default)]
    struct SharedBuffer(Arc<Mutex<Vec<u8>>>);

    impl Write for SharedBuffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn metrics(step: u64, reward: f64) -> StepMetrics {
        let mut metrics = StepMetrics::with_wall_time(step, 0.0);
        metrics.set("reward", reward).unwrap().set("kl", 0.000123).unwrap();
        metrics
    }

    #[test]
    fn line_mode_prints_every_n_steps_with_fields_and_phases() {
        let buffer = SharedBuffer::default();
        let options = ProgressOptions { line_every_steps: 2, ..ProgressOptions::default() };
        let progress = RunProgress::with_writer(5, options, Arc::new(Mutex::new(buffer.clone())));
        let phases = StepPhases {
            phases: vec![
                ("generate".into(), Duration::from_millis(1500)),
                ("train".into(), Duration::from_millis(250)),
            ],
        };
        for step in 1..=5 {
            progress.step_done(&metrics(step, step as f64 / 10.0), &phases);
        }
        progress.println("done");
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}"); // steps 1, 2, 4, 5 and the message
        assert!(lines[0].starts_with("step 1/5 ["), "{}", lines[0]);
        assert!(
            lines[0].ends_with("] reward 0.1000 kl 1.230e-4 | generate 1.50s  train 0.250s"),
            "{}",
            lines[0]
        );
        assert!(lines[1].starts_with("step 2/5"));
        assert!(lines[2].starts_with("step 4/5"));
        assert!(lines[3].starts_with("step 5/5"));
        assert_eq!(lines[4], "done");
    }

    #[test]
    fn status_line_skips_missing_fields() {
        let options = ProgressOptions {
            mode: ProgressMode::Hidden,
            fields: vec![
                ProgressField::new("acc", "eval/accuracy"),
                ProgressField::new("r", "reward"),
            ],
            ..ProgressOptions::default()
        };
        let progress = RunProgress::new(3, options);
        let line = progress.status_line(&metrics(1, 1234.5678), &StepPhases::default());
        assert_eq!(line, "r 1235");
        progress.step_done(&metrics(1, 0.0), &StepPhases::default());
        progress.finish();
    }

    #[test]
    fn bar_mode_tracks_position_and_message() {
        let progress = RunProgress::new(
            4,
            ProgressOptions { mode: ProgressMode::Bar, ..ProgressOptions::default() },
        );
        progress.set_phase("generate");
        progress.step_done(&metrics(2, 0.5), &StepPhases::default());
        progress.set_phase("train");
        let Output::Bar(bar) = &progress.output else { panic!("bar mode gives a bar") };
        assert_eq!(bar.position(), 2);
        assert_eq!(bar.message(), "reward 0.5000 kl 1.230e-4");
        assert_eq!(bar.prefix(), "train");
        progress.finish();
        assert!(bar.is_finished());
    }

    #[test]
    fn formats_values_with_four_significant_digits() {
        assert_eq!(format_value(0.0), "0.0000");
        assert_eq!(format_value(0.51234), "0.5123");
        assert_eq!(format_value(-2.5), "-2.500");
        assert_eq!(format_value(12.345), "12.35");
        assert_eq!(format_value(0.00001234), "1.234e-5");
        assert_eq!(format_value(123456.0), "1.235e5");
    }
}
