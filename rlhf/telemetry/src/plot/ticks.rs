//! Axis ranges and "nice" tick positions (multiples of 1, 2 or 5 × 10ᵏ) with labels that show
//! just enough decimals.

/// An axis: its displayed range, tick positions and tick labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    /// Value at the low end of the axis.
    pub min: f64,
    /// Value at the high end of the axis.
    pub max: f64,
    /// Tick positions, ascending, within `min..=max`.
    pub ticks: Vec<f64>,
    /// One label per tick.
    pub labels: Vec<String>,
}

/// Builds an axis covering `min..=max` with about `target_ticks` ticks. With `expand`, the range
/// grows to the enclosing tick multiples (a y axis); otherwise it is kept (an x axis of steps).
/// With `integer`, ticks are whole numbers. An empty or degenerate range is widened.
pub fn nice_axis(min: f64, max: f64, target_ticks: usize, expand: bool, integer: bool) -> Axis {
    let (mut min, mut max) =
        if min.is_finite() && max.is_finite() && min <= max { (min, max) } else { (0.0, 1.0) };
    if min == max {
        let pad = if min == 0.0 { 1.0 } else { min.abs() * 0.1 };
        min -= pad;
        max += pad;
    }
    let raw = (max - min) / target_ticks.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let normalized = raw / magnitude;
    let nice = if normalized <= 1.0 {
        1.0
    } else if normalized <= 2.0 {
        2.0
    } else if normalized <= 5.0 {
        5.0
    } else {
        10.0
    };
    let mut step = nice * magnitude;
    if integer {
        step = step.max(1.0).round();
    }
    if expand {
        min = (min / step).floor() * step;
        max = (max / step).ceil() * step;
    }
    let first = (min / step - 1e-9).ceil();
    let mut ticks = Vec::new();
    for index in 0.. {
        let tick = (first + f64::from(index)) * step;
        if tick > max + step * 1e-9 || index > 1000 {
            break;
        }
        // Snap values that are zero up to rounding noise (e.g. -1e-17) to zero.
        ticks.push(if tick.abs() < step * 1e-9 { 0.0 } else { tick });
    }
    let labels = ticks.iter().map(|&tick| format_tick(tick, step)).collect();
    Axis { min, max, ticks, labels }
}

/// Formats a tick value with as many decimals as the tick spacing needs; very large or small
/// values use scientific notation.
fn format_tick(value: f64, step: f64) -> String {
    let largest = value.abs().max(step.abs());
    if largest >= 1e6 || step < 1e-4 {
        let text = format!("{value:.1e}");
        return text.replace(".0e", "e");
    }
    let decimals = if step >= 1.0 { 0 } else { (-step.log10().floor()) as usize };
    format!("{value:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expanded_axis_encloses_the_data_on_tick_multiples() {
        let axis = nice_axis(0.03, 0.87, 5, true, false);
        assert_eq!((axis.min, axis.max), (0.0, 1.0));
        assert_eq!(axis.labels, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
    }

    #[test]
    fn step_axis_keeps_its_range_and_uses_integers() {
        let axis = nice_axis(1.0, 3.0, 8, false, true);
        assert_eq!((axis.min, axis.max), (1.0, 3.0));
        assert_eq!(axis.labels, ["1", "2", "3"]);
        let axis = nice_axis(0.0, 200.0, 6, false, true);
        assert_eq!(axis.labels, ["0", "50", "100", "150", "200"]);
    }

    #[test]
    fn degenerate_and_negative_ranges() {
        let axis = nice_axis(0.5, 0.5, 5, true, false);
        assert!(axis.min < 0.5 && axis.max > 0.5);
        assert_eq!(
            nice_axis(f64::NAN, 1.0, 5, true, false).labels.first().map(String::as_str),
            Some("0.0")
        );
        let axis = nice_axis(-1.3, 0.4, 5, true, false);
        assert_eq!(axis.labels, ["-1.5", "-1.0", "-0.5", "0.0", "0.5"]);
    }

    #[test]
    fn extreme_magnitudes_use_scientific_notation() {
        let axis = nice_axis(0.0, 3e7, 3, true, false);
        assert_eq!(axis.labels, ["0e0", "1e7", "2e7", "3e7"]);
        let axis = nice_axis(0.0, 3e-5, 3, true, false);
        assert_eq!(axis.labels.last().map(String::as_str), Some("3e-5"));
    }
}
