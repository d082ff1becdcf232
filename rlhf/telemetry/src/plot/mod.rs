//! Line charts rendered to PNG: the reward curve of a run (x = step, one line per series, e.g.
//! train reward and held-out reward) with axes, grid, tick labels, axis labels, title and
//! legend. Drawing is done here on a plain RGB raster with a built-in 5×7 bitmap font
//! (module `font`), so the crate builds offline without font or graphics system libraries; the `png`
//! crate only encodes the result.

mod canvas;
mod font;
mod ticks;

use std::path::Path;

pub use canvas::{Canvas, Rect, Rgb};
pub use ticks::{Axis, nice_axis};

use crate::error::{Result, TelemetryError, io_error};
use crate::metrics::StepMetrics;
use font::{GLYPH_HEIGHT, text_width};

/// Series colours, assigned in order (a colour-blind-safe palette).
pub const PALETTE: [Rgb; 6] =
    [[0, 114, 178], [213, 94, 0], [0, 158, 115], [204, 121, 167], [230, 159, 0], [86, 180, 233]];

/// Smallest chart the layout fits in.
const MIN_SIZE: (u32, u32) = (240, 180);
/// Largest chart accepted (keeps a bad config from allocating gigabytes).
const MAX_SIDE: u32 = 8192;
/// Font scale of all text but the title.
const TEXT_SCALE: i64 = 2;
/// Font scale of the title.
const TITLE_SCALE: i64 = 3;
/// Outer margin in pixels.
const MARGIN: i64 = 12;
/// Length of tick marks in pixels.
const TICK_LENGTH: i64 = 6;
/// Width of series lines in pixels.
const LINE_THICKNESS: i64 = 3;
/// Series with at most this many points also get a square marker per point.
const MAX_POINTS_WITH_MARKERS: usize = 60;
/// Side of a point marker in pixels.
const MARKER_SIZE: i64 = 5;

const BACKGROUND: Rgb = [255, 255, 255];
const GRID: Rgb = [228, 228, 228];
const AXIS: Rgb = [40, 40, 40];
const TEXT: Rgb = [20, 20, 20];

/// One line of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend entry.
    pub name: String,
    /// `(x, y)` points in drawing order; a non-finite point breaks the line.
    pub points: Vec<(f64, f64)>,
    /// Line colour.
    pub color: Rgb,
}

/// A line chart.
#[derive(Debug, Clone, PartialEq)]
pub struct LineChart {
    /// Title above the plot.
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// Label left of the y axis.
    pub y_label: String,
    /// Image width in pixels. Default 900.
    pub width: u32,
    /// Image height in pixels. Default 560.
    pub height: u32,
    /// The lines, drawn in order (later ones on top).
    pub series: Vec<Series>,
}

/// Where a chart's parts go, in pixels; [`ChartLayout::to_pixel`] maps data to the image.
#[derive(Debug, Clone, PartialEq)]
pub struct ChartLayout {
    /// The plotting area, edges included; the axes run along its left and bottom edges.
    pub plot_area: Rect,
    /// The x axis.
    pub x_axis: Axis,
    /// The y axis.
    pub y_axis: Axis,
    /// Top of each legend row.
    legend_rows: Vec<i64>,
}

impl ChartLayout {
    /// The pixel of data point `(x, y)`.
    pub fn to_pixel(&self, x: f64, y: f64) -> (i64, i64) {
        let area = self.plot_area;
        let fx = (x - self.x_axis.min) / (self.x_axis.max - self.x_axis.min);
        let fy = (y - self.y_axis.min) / (self.y_axis.max - self.y_axis.min);
        let px = area.left as f64 + fx * (area.right - area.left) as f64;
        let py = area.bottom as f64 - fy * (area.bottom - area.top) as f64;
        // Points come from inside the axes' ranges; the clamp only bounds what rounding noise or
        // a caller's out-of-range point could do (line drawing walks every pixel in between).
        let reach = 2.0 * (area.right.max(area.bottom) as f64 + 1.0);
        (px.clamp(-reach, reach).round() as i64, py.clamp(-reach, reach).round() as i64)
    }
}

impl LineChart {
    /// An empty 900×560 chart.
    pub fn new(
        title: impl Into<String>,
        x_label: impl Into<String>,
        y_label: impl Into<String>,
    ) -> Self {
        Self {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            width: 900,
            height: 560,
            series: Vec::new(),
        }
    }

    /// Adds a series with the next palette colour.
    pub fn add_series(&mut self, name: impl Into<String>, points: Vec<(f64, f64)>) -> &mut Self {
        let color = PALETTE[self.series.len() % PALETTE.len()];
        self.series.push(Series { name: name.into(), points, color });
        self
    }

    fn finite_points(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.series
            .iter()
            .flat_map(|series| series.points.iter().copied())
            .filter(|(x, y)| x.is_finite() && y.is_finite())
    }

    /// Computes axes and the plotting area.
    pub fn layout(&self) -> Result<ChartLayout> {
        let (width, height) = (self.width, self.height);
        if width < MIN_SIZE.0 || height < MIN_SIZE.1 || width > MAX_SIDE || height > MAX_SIDE {
            return Err(TelemetryError::InvalidChart {
                reason: format!(
                    "expected a size between {}x{} and {MAX_SIDE}x{MAX_SIDE} pixels, found {width}x{height}",
                    MIN_SIZE.0, MIN_SIZE.1
                ),
            });
        }
        let (mut x_min, mut x_max, mut y_min, mut y_max) =
            (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
        let mut integer_x = true;
        for (x, y) in self.finite_points() {
            (x_min, x_max) = (x_min.min(x), x_max.max(x));
            (y_min, y_max) = (y_min.min(y), y_max.max(y));
            integer_x &= x.fract() == 0.0;
        }
        if !(x_max - x_min).is_finite() && x_min.is_finite()
            || !(y_max - y_min).is_finite() && y_min.is_finite()
        {
            return Err(TelemetryError::InvalidChart {
                reason: format!(
                    "expected data spans that fit in a double, found x in [{x_min:e}, {x_max:e}] \
                     and y in [{y_min:e}, {y_max:e}]"
                ),
            });
        }
        let (width, height) = (i64::from(width), i64::from(height));
        let char_height = GLYPH_HEIGHT * TEXT_SCALE;
        let y_ticks_wanted = ((height - 200) / 60).clamp(3, 10) as usize;
        let x_ticks_wanted = ((width - 200) / 110).clamp(3, 10) as usize;
        let y_axis = nice_axis(y_min, y_max, y_ticks_wanted, true, false);
        let x_axis = nice_axis(x_min, x_max, x_ticks_wanted, false, integer_x);

        // Legend rows: entries flow left to right and wrap.
        let title_bottom = MARGIN + GLYPH_HEIGHT * TITLE_SCALE;
        let mut legend_rows = Vec::new();
        let mut cursor = width;
        let mut row_top = title_bottom;
        for series in &self.series {
            let entry = legend_entry_width(&series.name);
            if cursor + entry > width - MARGIN {
                row_top += char_height + 8;
                legend_rows.push(row_top);
                cursor = MARGIN;
            }
            cursor += entry + 24;
        }
        let top = row_top + char_height + 12;
        let widest_y_label =
            y_axis.labels.iter().map(|label| text_width(label, TEXT_SCALE)).max().unwrap_or(0);
        let left = MARGIN + char_height + 10 + widest_y_label + 4 + TICK_LENGTH;
        let bottom = height - (MARGIN + char_height + 10 + char_height + 4 + TICK_LENGTH);
        let widest_x_label = x_axis.labels.last().map_or(0, |label| text_width(label, TEXT_SCALE));
        let right = width - MARGIN - widest_x_label / 2 - 4;
        if right - left < 40 || bottom - top < 40 {
            return Err(TelemetryError::InvalidChart {
                reason: format!(
                    "{}x{} pixels leave no room to plot after the labels and legend ({} series)",
                    self.width,
                    self.height,
                    self.series.len()
                ),
            });
        }
        let plot_area = Rect { left, top, right, bottom };
        Ok(ChartLayout { plot_area, x_axis, y_axis, legend_rows })
    }

    /// Draws the chart.
    pub fn render(&self) -> Result<Canvas> {
        let layout = self.layout()?;
        let area = layout.plot_area;
        let mut canvas = Canvas::new(self.width, self.height, BACKGROUND);
        let everywhere = Rect {
            left: 0,
            top: 0,
            right: i64::from(self.width) - 1,
            bottom: i64::from(self.height) - 1,
        };
        let char_height = GLYPH_HEIGHT * TEXT_SCALE;

        // Grid, ticks and tick labels.
        for (tick, label) in layout.y_axis.ticks.iter().zip(&layout.y_axis.labels) {
            let (_, y) = layout.to_pixel(layout.x_axis.min, *tick);
            canvas.line((area.left, y), (area.right, y), GRID, 1, everywhere);
            canvas.line((area.left - TICK_LENGTH, y), (area.left, y), AXIS, 1, everywhere);
            let label_x = area.left - TICK_LENGTH - 4 - text_width(label, TEXT_SCALE);
            canvas.text(label_x, y - char_height / 2, label, TEXT, TEXT_SCALE);
        }
        for (tick, label) in layout.x_axis.ticks.iter().zip(&layout.x_axis.labels) {
            let (x, _) = layout.to_pixel(*tick, layout.y_axis.min);
            canvas.line((x, area.top), (x, area.bottom), GRID, 1, everywhere);
            canvas.line((x, area.bottom), (x, area.bottom + TICK_LENGTH), AXIS, 1, everywhere);
            let label_x = x - text_width(label, TEXT_SCALE) / 2;
            canvas.text(label_x, area.bottom + TICK_LENGTH + 4, label, TEXT, TEXT_SCALE);
        }
        canvas.line((area.left, area.top), (area.left, area.bottom), AXIS, 1, everywhere);
        canvas.line((area.left, area.bottom), (area.right, area.bottom), AXIS, 1, everywhere);

        // Axis labels and title.
        let x_label_width = text_width(&self.x_label, TEXT_SCALE);
        let x_label_top = area.bottom + TICK_LENGTH + 4 + char_height + 10;
        canvas.text(
            (area.left + area.right - x_label_width) / 2,
            x_label_top,
            &self.x_label,
            TEXT,
            TEXT_SCALE,
        );
        let y_label_width = text_width(&self.y_label, TEXT_SCALE);
        let y_label_bottom = (area.top + area.bottom + y_label_width) / 2;
        canvas.text_vertical(MARGIN, y_label_bottom, &self.y_label, TEXT, TEXT_SCALE);
        let title_width = text_width(&self.title, TITLE_SCALE);
        canvas.text(
            (i64::from(self.width) - title_width) / 2,
            MARGIN,
            &self.title,
            TEXT,
            TITLE_SCALE,
        );

        // Legend: a short line in the series colour, then its name.
        let mut rows = layout.legend_rows.iter();
        let mut row_top = 0;
        let mut cursor = i64::from(self.width);
        for series in &self.series {
            let entry = legend_entry_width(&series.name);
            if cursor + entry > i64::from(self.width) - MARGIN {
                row_top = *rows.next().expect("layout made one legend row per wrap");
                cursor = MARGIN;
            }
            let middle = row_top + char_height / 2;
            canvas.line((cursor, middle), (cursor + 24, middle), series.color, 3, everywhere);
            canvas.text(cursor + 32, row_top, &series.name, TEXT, TEXT_SCALE);
            cursor += entry + 24;
        }

        // Series last, so lines are never hidden under grid or axes.
        for series in &self.series {
            let markers = series.points.len() <= MAX_POINTS_WITH_MARKERS;
            let mut previous = None;
            for &(x, y) in &series.points {
                if !(x.is_finite() && y.is_finite()) {
                    previous = None;
                    continue;
                }
                let pixel = layout.to_pixel(x, y);
                canvas.line(previous.unwrap_or(pixel), pixel, series.color, LINE_THICKNESS, area);
                if markers {
                    let half = MARKER_SIZE / 2;
                    let marker = Rect {
                        left: pixel.0 - half,
                        top: pixel.1 - half,
                        right: pixel.0 + half,
                        bottom: pixel.1 + half,
                    };
                    let clipped = Rect {
                        left: marker.left.max(area.left),
                        top: marker.top.max(area.top),
                        right: marker.right.min(area.right),
                        bottom: marker.bottom.min(area.bottom),
                    };
                    canvas.fill_rect(clipped, series.color);
                }
                previous = Some(pixel);
            }
        }
        Ok(canvas)
    }

    /// Renders the chart as PNG bytes.
    pub fn to_png(&self) -> Result<Vec<u8>> {
        self.render()?.to_png()
    }

    /// Renders the chart into a PNG file (written whole, then renamed into place).
    pub fn write_png(&self, path: &Path) -> Result<()> {
        let bytes = self.to_png()?;
        let mut temporary = path.as_os_str().to_owned();
        temporary.push(".tmp");
        std::fs::write(&temporary, bytes).map_err(io_error("write", &temporary))?;
        std::fs::rename(&temporary, path).map_err(io_error("replace", path))
    }
}

/// Pixels a legend entry takes: the colour sample, a gap, the name.
fn legend_entry_width(name: &str) -> i64 {
    32 + text_width(name, TEXT_SCALE)
}

/// A reward curve from recorded metrics: one series per `(legend name, metric name)`, with the
/// steps that recorded that metric (held-out reward is typically evaluated every few steps).
pub fn reward_curve(records: &[StepMetrics], series: &[(&str, &str)]) -> LineChart {
    let mut chart = LineChart::new("Reward", "step", "reward");
    for (name, metric) in series {
        let points = records
            .iter()
            .filter_map(|record| record.get(metric).map(|value| (record.step() as f64, value)))
            .collect();
        chart.add_series(*name, points);
    }
    chart
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bytes: &[u8]) -> (png::OutputInfo, Vec<u8>) {
        let mut reader = png::Decoder::new(std::io::Cursor::new(bytes)).read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut pixels).unwrap();
        pixels.truncate(info.buffer_size());
        (info, pixels)
    }

    fn pixel(pixels: &[u8], width: u32, (x, y): (i64, i64)) -> Rgb {
        let index = (y as usize * width as usize + x as usize) * 3;
        [pixels[index], pixels[index + 1], pixels[index + 2]]
    }

    fn sample_chart() -> LineChart {
        let mut records = Vec::new();
        for step in 1..=20u64 {
            let mut metrics = StepMetrics::with_wall_time(step, 0.0);
            // Train reward rises from 0.1 to 0.67; held-out is evaluated every 5 steps, higher.
            metrics.set("reward", 0.1 + 0.03 * step as f64).unwrap();
            if step % 5 == 0 {
                metrics.set("eval/reward", 0.8 + 0.01 * step as f64).unwrap();
            }
            records.push(metrics);
        }
        reward_curve(&records, &[("train reward", "reward"), ("held-out reward", "eval/reward")])
    }

    #[test]
    fn decoded_png_has_series_pixels_where_the_data_is() {
        let chart = sample_chart();
        let steps: Vec<f64> = chart.series[1].points.iter().map(|&(x, _)| x).collect();
        assert_eq!(steps, [5.0, 10.0, 15.0, 20.0]);
        assert_eq!(chart.series[0].points.len(), 20);
        let layout = chart.layout().unwrap();
        let (info, pixels) = decode(&chart.to_png().unwrap());
        assert_eq!((info.width, info.height), (900, 560));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        let at = |point| pixel(&pixels, info.width, point);

        // Axes: integer steps 1..=20 as given, reward expanded to nice bounds.
        assert_eq!((layout.x_axis.min, layout.x_axis.max), (1.0, 20.0));
        assert!(layout.y_axis.min <= 0.13 && layout.y_axis.max >= 1.0);
        for series in &chart.series {
            for &(x, y) in &series.points {
                assert_eq!(
                    at(layout.to_pixel(x, y)),
                    series.color,
                    "{} at ({x}, {y})",
                    series.name
                );
            }
            // Midpoints of segments lie on the line.
            for pair in series.points.windows(2) {
                let (x, y) = ((pair[0].0 + pair[1].0) / 2.0, (pair[0].1 + pair[1].1) / 2.0);
                assert_eq!(
                    at(layout.to_pixel(x, y)),
                    series.color,
                    "{} between points",
                    series.name
                );
            }
        }
        // Far from both lines the plot is background or grid.
        let empty = at(layout.to_pixel(19.0, 0.2));
        assert!(empty == BACKGROUND || empty == GRID, "{empty:?}");
        // The axes are drawn along the plot area's left and bottom edges.
        let area = layout.plot_area;
        assert_eq!(at((area.left, (area.top + area.bottom) / 2)), AXIS);
        assert_eq!(at(((area.left + area.right) / 2, area.bottom)), AXIS);
        // Text was drawn: title, tick labels, axis labels and legend have dark pixels outside the plot.
        let dark_outside = (0..info.height as i64)
            .flat_map(|y| (0..info.width as i64).map(move |x| (x, y)))
            .filter(|&(x, y)| !area.contains(x, y) && at((x, y)) == TEXT)
            .count();
        assert!(dark_outside > 2000, "only {dark_outside} text pixels");
        // The legend shows each series' colour above the plot.
        for series in &chart.series {
            let legend = (0..area.top).flat_map(|y| (0..info.width as i64).map(move |x| (x, y)));
            assert!(
                legend.clone().any(|point| at(point) == series.color),
                "{} not in legend",
                series.name
            );
        }
    }

    #[test]
    fn handles_empty_constant_and_non_finite_data() {
        let mut chart = LineChart::new("empty", "step", "reward");
        let canvas = chart.render().unwrap();
        assert_eq!((canvas.width(), canvas.height()), (900, 560));

        chart.add_series("flat", vec![(0.0, 0.5), (1.0, f64::NAN), (2.0, 0.5), (3.0, 0.5)]);
        let layout = chart.layout().unwrap();
        assert!(layout.y_axis.min < 0.5 && layout.y_axis.max > 0.5);
        let canvas = chart.render().unwrap();
        let color = chart.series[0].color;
        assert_eq!(
            canvas.pixel(layout.to_pixel(2.5, 0.5).0, layout.to_pixel(2.5, 0.5).1),
            Some(color)
        );
        // The NaN breaks the line: nothing between x = 0 and x = 2 apart from the first marker.
        let gap = layout.to_pixel(1.0, 0.5);
        assert_ne!(canvas.pixel(gap.0, gap.1), Some(color));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        #[test]
        fn arbitrary_data_renders_or_is_rejected(
            series in proptest::collection::vec(
                proptest::collection::vec((proptest::num::f64::ANY, proptest::num::f64::ANY), 0..12),
                0..4,
            ),
            size in (240u32..1200, 180u32..900),
        ) {
            let mut chart = LineChart::new("fuzz", "x", "y");
            (chart.width, chart.height) = size;
            for (index, points) in series.into_iter().enumerate() {
                chart.add_series(format!("series {index}"), points);
            }
            match chart.render() {
                Ok(canvas) => proptest::prop_assert_eq!((canvas.width(), canvas.height()), size),
                Err(error) => {
                    let rejected = matches!(error, TelemetryError::InvalidChart { .. });
                    proptest::prop_assert!(rejected, "unexpected error: {}", error);
                },
            }
        }
    }

    #[test]
    fn rejects_sizes_that_cannot_hold_a_chart() {
        let mut chart = sample_chart();
        for (width, height) in [(100, 560), (900, 20), (100_000, 560)] {
            (chart.width, chart.height) = (width, height);
            let error = chart.render().unwrap_err();
            assert!(matches!(error, TelemetryError::InvalidChart { .. }), "{width}x{height}");
        }
        let mut chart = LineChart::new("huge", "step", "reward");
        chart.add_series("span", vec![(0.0, -1e308), (1.0, 1e308)]);
        let error = chart.render().unwrap_err().to_string();
        assert!(error.contains("expected data spans that fit in a double"), "{error}");
    }

    /// Writes the sample chart to `$RTRUN_TELEMETRY_SAMPLE_PNG` when set, to look at it.
    #[test]
    fn writes_a_png_file() {
        if let Some(path) = std::env::var_os("RTRUN_TELEMETRY_SAMPLE_PNG") {
            sample_chart().write_png(Path::new(&path)).unwrap();
        }
        let dir = std::env::temp_dir().join(format!("rtrun-telemetry-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("reward.png");
        sample_chart().write_png(&path).unwrap();
        let (info, _) = decode(&std::fs::read(&path).unwrap());
        assert_eq!((info.width, info.height), (900, 560));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
