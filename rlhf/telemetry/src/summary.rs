//! The end-of-run summary: held-out metrics before and after training and the per-phase timings,
//! as aligned plain text for the terminal or as Markdown for a closing note.

use std::time::Duration;

use crate::phase::{PhaseTotal, format_seconds};

/// One held-out metric, measured before training (if it was) and at the end.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalRow {
    /// The metric, e.g. `mean reward` or `accuracy`.
    pub metric: String,
    /// Value on the held-out prompts before the first step.
    pub baseline: Option<f64>,
    /// Value on the held-out prompts after the last step.
    pub final_value: Option<f64>,
}

/// Everything the end-of-run summary shows.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// A title, e.g. the config name and algorithm.
    pub title: String,
    /// Steps completed.
    pub steps: u64,
    /// The checkpoint step this run resumed from (the steps after it ran in `wall_time`).
    pub resumed_from: Option<u64>,
    /// Wall time of the run.
    pub wall_time: Duration,
    /// Number of held-out prompts the evaluation used.
    pub held_out_prompts: usize,
    /// Held-out metrics, baseline vs final.
    pub held_out: Vec<EvalRow>,
    /// Accumulated phase timings (from [`crate::PhaseTimer::totals`]).
    pub phases: Vec<PhaseTotal>,
}

/// Column alignment of a [`Table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Text columns.
    Left,
    /// Number columns.
    Right,
}

/// A small table rendered as aligned text or Markdown.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// Column headers.
    pub header: Vec<String>,
    /// Alignment per column.
    pub align: Vec<Align>,
    /// Cells, one row per entry; short rows are padded with empty cells.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with the given headers; the first column left-aligned, the others right-aligned.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        let header: Vec<String> = header.into_iter().map(Into::into).collect();
        let align =
            (0..header.len()).map(|i| if i == 0 { Align::Left } else { Align::Right }).collect();
        Self { header, align, rows: Vec::new() }
    }

    /// Appends a row.
    pub fn push_row<S: Into<String>>(&mut self, row: impl IntoIterator<Item = S>) {
        self.rows.push(row.into_iter().map(Into::into).collect());
    }

    fn columns(&self) -> usize {
        self.rows.iter().map(Vec::len).chain([self.header.len()]).max().unwrap_or(0)
    }

    fn cell(row: &[String], column: usize) -> &str {
        row.get(column).map_or("", String::as_str)
    }

    fn align(&self, column: usize) -> Align {
        self.align.get(column).copied().unwrap_or(Align::Right)
    }

    /// Aligned plain text: header, a rule of dashes, rows; columns separated by two spaces.
    pub fn to_text(&self) -> String {
        let columns = self.columns();
        let widths: Vec<usize> = (0..columns)
            .map(|column| {
                std::iter::once(&self.header)
                    .chain(&self.rows)
                    .map(|row| Self::cell(row, column).chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let render = |row: &[String]| {
            let cells: Vec<String> = (0..columns)
                .map(|column| {
                    let cell = Self::cell(row, column);
                    match self.align(column) {
                        Align::Left => format!("{cell:<width$}", width = widths[column]),
                        Align::Right => format!("{cell:>width$}", width = widths[column]),
                    }
                })
                .collect();
            cells.join("  ").trim_end().to_owned()
        };
        let mut out = render(&self.header);
        out.push('\n');
        let rule: Vec<String> = widths.iter().map(|&width| "-".repeat(width)).collect();
        out.push_str(&rule.join("  "));
        out.push('\n');
        for row in &self.rows {
            out.push_str(&render(row));
            out.push('\n');
        }
        out
    }

    /// A GitHub-flavoured Markdown table (`|` in cells is escaped).
    pub fn to_markdown(&self) -> String {
        let columns = self.columns();
        let render = |row: &[String]| {
            let cells: Vec<String> =
                (0..columns).map(|column| Self::cell(row, column).replace('|', "\\|")).collect();
            format!("| {} |", cells.join(" | "))
        };
        let mut out = render(&self.header);
        out.push('\n');
        let rule: Vec<&str> = (0..columns)
            .map(|column| match self.align(column) {
                Align::Left => ":---",
                Align::Right => "---:",
            })
            .collect();
        out.push_str(&format!("| {} |\n", rule.join(" | ")));
        for row in &self.rows {
            out.push_str(&render(row));
            out.push('\n');
        }
        out
    }
}

impl RunSummary {
    /// The held-out table: metric, baseline, final, change.
    pub fn held_out_table(&self) -> Table {
        let mut table = Table::new(["held-out metric", "baseline", "final", "change"]);
        for row in &self.held_out {
            let change = match (row.baseline, row.final_value) {
                (Some(baseline), Some(final_value)) => format!("{:+.4}", final_value - baseline),
                _ => "-".to_owned(),
            };
            table.push_row([
                row.metric.clone(),
                value(row.baseline),
                value(row.final_value),
                change,
            ]);
        }
        table
    }

    /// The timing table: phase, total, mean per step, max per step, share of the summed phase
    /// time (phases that overlap are each counted in full).
    pub fn phase_table(&self) -> Table {
        let mut table = Table::new(["phase", "total", "per step", "max", "share"]);
        let sum: Duration = self.phases.iter().map(|phase| phase.total).sum();
        for phase in &self.phases {
            let share = if sum.is_zero() {
                "-".to_owned()
            } else {
                format!("{:.1}%", 100.0 * phase.total.as_secs_f64() / sum.as_secs_f64())
            };
            table.push_row([
                phase.name.clone(),
                format_seconds(phase.total),
                format_seconds(phase.mean()),
                format_seconds(phase.max),
                share,
            ]);
        }
        table
    }

    fn heading(&self) -> String {
        let steps = match self.resumed_from {
            Some(from) => format!(
                "{} steps, resumed from step {from}: steps {}-{} in {}",
                self.steps,
                from + 1,
                self.steps,
                format_seconds(self.wall_time)
            ),
            None => format!("{} steps in {}", self.steps, format_seconds(self.wall_time)),
        };
        format!("{}: {steps}, {} held-out prompts", self.title, self.held_out_prompts)
    }

    /// The summary as plain text for the terminal.
    pub fn to_text(&self) -> String {
        format!(
            "{}\n\n{}\n{}",
            self.heading(),
            self.held_out_table().to_text(),
            self.phase_table().to_text()
        )
    }

    /// The summary as Markdown.
    pub fn to_markdown(&self) -> String {
        format!(
            "**{}**\n\n{}\n{}",
            self.heading(),
            self.held_out_table().to_markdown(),
            self.phase_table().to_markdown()
        )
    }
}

fn value(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |value| format!("{value:.4}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary() -> RunSummary {
        RunSummary {
            title: "grpo-tiny".into(),
            steps: 20,
            resumed_from: None,
            wall_time: Duration::from_secs(95),
            held_out_prompts: 64,
            held_out: vec![
                EvalRow {
                    metric: "mean reward".into(),
                    baseline: Some(0.125),
                    final_value: Some(0.84375),
                },
                EvalRow { metric: "kl | ref".into(), baseline: None, final_value: Some(0.02) },
            ],
            phases: vec![
                PhaseTotal {
                    name: "generate".into(),
                    total: Duration::from_secs(60),
                    steps: 20,
                    max: Duration::from_secs(4),
                },
                PhaseTotal {
                    name: "train".into(),
                    total: Duration::from_secs(20),
                    steps: 20,
                    max: Duration::from_secs(2),
                },
            ],
        }
    }

    #[test]
    fn renders_aligned_text() {
        let text = summary().to_text();
        let expected = "\
grpo-tiny: 20 steps in 1m35s, 64 held-out prompts

held-out metric  baseline   final   change
---------------  --------  ------  -------
mean reward        0.1250  0.8438  +0.7188
kl | ref                -  0.0200        -

phase     total  per step    max  share
--------  -----  --------  -----  -----
generate  1m00s     3.00s  4.00s  75.0%
train     20.0s     1.00s  2.00s  25.0%
";
        assert_eq!(text, expected);
    }

    #[test]
    fn renders_markdown() {
        let markdown = summary().to_markdown();
        assert!(markdown.starts_with("**grpo-tiny: 20 steps in 1m35s, 64 held-out prompts**\n\n"));
        // A resumed run says which steps its time covers.
        let resumed = RunSummary { resumed_from: Some(15), ..summary() };
        assert!(resumed.to_text().starts_with(
            "grpo-tiny: 20 steps, resumed from step 15: steps 16-20 in 1m35s, 64 held-out prompts"
        ));
        assert!(markdown.contains(
            "| held-out metric | baseline | final | change |\n| :--- | ---: | ---: | ---: |\n"
        ));
        assert!(markdown.contains("| mean reward | 0.1250 | 0.8438 | +0.7188 |\n"));
        assert!(markdown.contains("| kl \\| ref | - | 0.0200 | - |\n"));
        assert!(markdown.contains("| generate | 1m00s | 3.00s | 4.00s | 75.0% |\n"));
    }

    #[test]
    fn empty_phases_have_no_share() {
        let mut summary = summary();
        summary.phases[0].total = Duration::ZERO;
        summary.phases[1].total = Duration::ZERO;
        let text = summary.phase_table().to_text();
        let generate: Vec<&str> = text.lines().nth(2).unwrap().split_whitespace().collect();
        assert_eq!(generate, ["generate", "0.000s", "0.000s", "4.00s", "-"]);
    }
}
