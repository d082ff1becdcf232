//! The newest step of a running `train`, exported as Prometheus gauges beside the runtime's
//! metrics (`train --metrics-port`): the step, every scalar of the step's metrics (reward, KL,
//! losses, eval results when the step evaluated), the step's phase times, its wall time and its
//! generated tokens per second; and for the dashboard (`train --dashboard-port`) a page with
//! the run's curves so far (reward and KL for RL, losses for SFT).

use std::sync::Mutex;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::StepMetrics;
use crate::phase::StepPhases;

type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;
type Labels = Vec<(String, String)>;

/// The scalar that holds a step's generated tokens (responses summed over the rollout).
pub const GENERATED_TOKENS: &str = "generated_tokens";

#[derive(Debug, Default)]
struct Live {
    total_steps: u64,
    last: Option<(StepMetrics, StepPhases)>,
    /// The latest value of every scalar seen (eval results persist between evaluations).
    latest: Vec<(String, f64)>,
    /// Every step so far (for the curves; the newest [`MAX_RECORDS`]).
    records: Vec<StepMetrics>,
    /// The newest step's logged samples.
    samples: Vec<crate::samples::SampleRow>,
}

/// Steps kept for the dashboard's curves.
pub const MAX_RECORDS: usize = 20_000;

/// One curve chart of the dashboard page: its title, y-axis label and `(legend, metric)` series.
#[derive(Debug, Clone, PartialEq)]
pub struct ChartSpec {
    /// The chart's title.
    pub title: String,
    /// The y-axis label.
    pub y_label: String,
    /// `(legend, metric name)` of each line.
    pub series: Vec<(String, String)>,
}

impl ChartSpec {
    /// A chart of `series` (`(legend, metric)`).
    pub fn new(title: &str, y_label: &str, series: &[(&str, &str)]) -> Self {
        Self {
            title: title.to_owned(),
            y_label: y_label.to_owned(),
            series: series.iter().map(|(l, m)| ((*l).to_owned(), (*m).to_owned())).collect(),
        }
    }
}

/// Shared between the trainer's progress observer (writes) and the metrics endpoint (reads).
#[derive(Debug)]
pub struct LiveMetrics {
    live: Mutex<Live>,
    charts: Vec<ChartSpec>,
}

impl Default for LiveMetrics {
    /// The RL run's charts: reward (train and held-out) and KL.
    fn default() -> Self {
        Self::with_charts(vec![
            ChartSpec::new(
                "Reward",
                "reward",
                &[("train reward", "reward"), ("held-out reward", "eval/reward")],
            ),
            ChartSpec::new("KL to the reference", "KL", &[("KL", "kl")]),
        ])
    }
}

impl LiveMetrics {
    /// Live metrics whose dashboard page draws `charts`.
    pub fn with_charts(charts: Vec<ChartSpec>) -> Self {
        Self { live: Mutex::default(), charts }
    }

    /// The run's planned number of steps.
    pub fn set_total_steps(&self, total: u64) {
        if let Ok(mut live) = self.live.lock() {
            live.total_steps = total;
        }
    }

    /// A finished step.
    pub fn record(&self, metrics: &StepMetrics, phases: &StepPhases) {
        let Ok(mut live) = self.live.lock() else { return };
        for (name, value) in metrics.scalars() {
            match live.latest.iter_mut().find(|(n, _)| n == name) {
                Some(slot) => slot.1 = *value,
                None => live.latest.push((name.clone(), *value)),
            }
        }
        live.last = Some((metrics.clone(), phases.clone()));
        if live.records.len() == MAX_RECORDS {
            live.records.remove(0);
        }
        live.records.push(metrics.clone());
    }

    /// Keeps `rows` (one step's logged samples) for the dashboard page.
    pub fn record_samples(&self, rows: &[crate::samples::SampleRow]) {
        if let Ok(mut live) = self.live.lock() {
            live.samples = rows.to_vec();
        }
    }

    /// The dashboard page: progress, the newest metrics, the reward and KL curves (PNG data
    /// URIs drawn like `reward.png`) and the newest step's logged samples.
    pub fn dashboard_html(&self) -> String {
        use base64::Engine as _;
        let Ok(live) = self.live.lock() else { return "<p>metrics unavailable</p>".into() };
        let Some((last, phases)) = &live.last else {
            return format!("<p>Warming up: no step finished yet (of {}).</p>", live.total_steps);
        };
        let mut html = format!(
            "<p>step <b>{}</b> of {}; last step {:.2} s</p>\n",
            last.step(),
            live.total_steps,
            phases.phases.iter().map(|(_, d)| d.as_secs_f64()).sum::<f64>()
        );
        for spec in &self.charts {
            let series: Vec<(&str, &str)> =
                spec.series.iter().map(|(l, m)| (l.as_str(), m.as_str())).collect();
            let mut chart = crate::reward_curve(&live.records, &series);
            chart.title = spec.title.clone();
            chart.y_label = spec.y_label.clone();
            match chart.to_png() {
                Ok(png) => html.push_str(&format!(
                    "<img alt=\"{}\" src=\"data:image/png;base64,{}\" width=\"600\">\n",
                    escape(&chart.title),
                    base64::engine::general_purpose::STANDARD.encode(png)
                )),
                Err(e) => html.push_str(&format!("<p>chart: {}</p>", escape(&e.to_string()))),
            }
        }
        html.push_str("<table><tr><th>metric</th><th>newest value</th></tr>\n");
        for (name, value) in &live.latest {
            html.push_str(&format!("<tr><td>{}</td><td>{value:.6}</td></tr>\n", escape(name)));
        }
        html.push_str("</table>\n");
        if let Some(step) = live.samples.first().map(|r| r.step) {
            // Long texts are cut: the page stays readable and small.
            let cut = |text: &str| escape(&text.chars().take(400).collect::<String>());
            html.push_str(&format!(
                "<h3>Samples of step {step}</h3>\n<table><tr><th>prompt</th><th>response</th>\
                 <th>reward</th><th>label</th></tr>\n"
            ));
            for row in &live.samples {
                html.push_str(&format!(
                    "<tr><td>{}</td><td>{}</td><td>{:.4}</td><td>{}</td></tr>\n",
                    cut(&row.prompt),
                    cut(&row.response),
                    row.reward,
                    cut(&row.label)
                ));
            }
            html.push_str("</table>\n");
        }
        html
    }

    /// Registers the gauges of the newest step into a scrape's `registry`.
    pub fn register(&self, registry: &mut Registry) {
        let Ok(live) = self.live.lock() else { return };
        let gauge = |registry: &mut Registry, name: &str, help: &str, value: f64| {
            let gauge = FloatGauge::default();
            gauge.set(value);
            registry.register(name, help, gauge);
        };
        gauge(registry, "rtrun_train_total_steps", "Steps the run plans", live.total_steps as f64);
        let Some((metrics, phases)) = &live.last else { return };
        gauge(registry, "rtrun_train_step", "The newest finished step", metrics.step() as f64);
        let scalars = Family::<Labels, FloatGauge>::default();
        registry.register(
            "rtrun_train_metric",
            "The newest value of each step metric (metrics.jsonl's keys as `name`)",
            scalars.clone(),
        );
        for (name, value) in &live.latest {
            scalars.get_or_create(&vec![("name".to_owned(), name.clone())]).set(*value);
        }
        let phase_seconds = Family::<Labels, FloatGauge>::default();
        registry.register(
            "rtrun_train_phase_seconds",
            "Time of each phase in the newest step",
            phase_seconds.clone(),
        );
        let mut step_seconds = 0.0;
        for (phase, took) in &phases.phases {
            phase_seconds
                .get_or_create(&vec![("phase".to_owned(), phase.clone())])
                .set(took.as_secs_f64());
            step_seconds += took.as_secs_f64();
        }
        gauge(registry, "rtrun_train_step_seconds", "Wall time of the newest step", step_seconds);
        if let Some(tokens) = metrics.get(GENERATED_TOKENS)
            && step_seconds > 0.0
        {
            gauge(
                registry,
                "rtrun_train_tokens_per_second",
                "Generated tokens per second of wall time in the newest step",
                tokens / step_seconds,
            );
        }
    }
}

/// Text for HTML.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn encoded(live: &LiveMetrics) -> String {
        let mut registry = Registry::default();
        live.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn the_newest_step_and_the_latest_eval_are_exported() {
        let live = LiveMetrics::default();
        live.set_total_steps(10);
        assert!(!encoded(&live).contains("rtrun_train_step "), "no step yet");
        let mut first = StepMetrics::with_wall_time(1, 0.0);
        first.set("reward", 0.25).unwrap().set("eval/reward", 0.5).unwrap();
        first.set(GENERATED_TOKENS, 300.0).unwrap();
        let phases = StepPhases {
            phases: vec![
                ("generate".into(), Duration::from_millis(500)),
                ("train".into(), Duration::from_millis(1000)),
            ],
        };
        live.record(&first, &phases);
        let mut second = StepMetrics::with_wall_time(2, 0.0);
        second.set("reward", 0.75).unwrap().set(GENERATED_TOKENS, 600.0).unwrap();
        live.record(&second, &phases);
        let text = encoded(&live);
        let page = live.dashboard_html();
        assert!(page.contains("step <b>2</b> of 10"), "{page}");
        assert_eq!(page.matches("src=\"data:image/png;base64,").count(), 2, "{page}");
        assert!(page.contains("<td>eval/reward</td><td>0.500000</td>"), "{page}");
        assert!(!page.contains("Samples of step"), "none logged yet");
        live.record_samples(&[crate::samples::SampleRow {
            step: 2,
            prompt: "<b>12+3=".into(),
            response: "15".into(),
            reward: 1.0,
            label: "15".into(),
        }]);
        let page = live.dashboard_html();
        assert!(page.contains("<h3>Samples of step 2</h3>"), "{page}");
        assert!(page.contains("<td>&lt;b&gt;12+3=</td><td>15</td><td>1.0000</td>"), "{page}");
        for line in [
            "rtrun_train_total_steps 10.0",
            "rtrun_train_step 2.0",
            "rtrun_train_metric{name=\"reward\"} 0.75",
            "rtrun_train_metric{name=\"eval/reward\"} 0.5",
            "rtrun_train_phase_seconds{phase=\"train\"} 1.0",
            "rtrun_train_step_seconds 1.5",
            "rtrun_train_tokens_per_second 400.0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
