//! An RGB raster with the few drawing operations a line chart needs (rectangles, thick lines
//! clipped to a rectangle, bitmap text), and PNG encoding through the `png` crate.

use super::font::{ADVANCE, GLYPH_HEIGHT, GLYPH_WIDTH, glyph};
use crate::error::Result;

/// An RGB colour.
pub type Rgb = [u8; 3];

/// An axis-aligned rectangle in pixels, edges inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    /// Leftmost column.
    pub left: i64,
    /// Topmost row.
    pub top: i64,
    /// Rightmost column.
    pub right: i64,
    /// Bottom row.
    pub bottom: i64,
}

impl Rect {
    /// Whether `(x, y)` lies inside (edges included).
    pub fn contains(&self, x: i64, y: i64) -> bool {
        (self.left..=self.right).contains(&x) && (self.top..=self.bottom).contains(&y)
    }
}

/// An 8-bit RGB image, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Canvas {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
}

impl Canvas {
    /// A canvas filled with `background`.
    pub fn new(width: u32, height: u32, background: Rgb) -> Self {
        let pixels = background.repeat(width as usize * height as usize);
        Self { width, height, pixels }
    }

    /// Width in pixels.
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> u32 {
        self.height
    }

    /// The RGB bytes, row-major.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// The colour at `(x, y)`, or `None` outside the canvas.
    pub fn pixel(&self, x: i64, y: i64) -> Option<Rgb> {
        let index = self.index(x, y)?;
        Some([self.pixels[index], self.pixels[index + 1], self.pixels[index + 2]])
    }

    fn index(&self, x: i64, y: i64) -> Option<usize> {
        let inside =
            (0..i64::from(self.width)).contains(&x) && (0..i64::from(self.height)).contains(&y);
        inside.then(|| (y as usize * self.width as usize + x as usize) * 3)
    }

    /// Sets one pixel; outside the canvas nothing happens.
    pub fn set(&mut self, x: i64, y: i64, color: Rgb) {
        if let Some(index) = self.index(x, y) {
            self.pixels[index..index + 3].copy_from_slice(&color);
        }
    }

    /// Fills the rectangle (clipped to the canvas).
    pub fn fill_rect(&mut self, rect: Rect, color: Rgb) {
        for y in rect.top.max(0)..=rect.bottom.min(i64::from(self.height) - 1) {
            for x in rect.left.max(0)..=rect.right.min(i64::from(self.width) - 1) {
                self.set(x, y, color);
            }
        }
    }

    /// Draws a line `thickness` pixels wide between two points (Bresenham with a square brush),
    /// keeping only the pixels inside `clip`.
    pub fn line(
        &mut self,
        from: (i64, i64),
        to: (i64, i64),
        color: Rgb,
        thickness: i64,
        clip: Rect,
    ) {
        let (mut x, mut y) = from;
        let dx = (to.0 - x).abs();
        let dy = -(to.1 - y).abs();
        let step_x = if x < to.0 { 1 } else { -1 };
        let step_y = if y < to.1 { 1 } else { -1 };
        let mut error = dx + dy;
        // The brush extends `low` pixels up/left of the centre and `thickness - 1 - low` down/right.
        let low = (thickness - 1) / 2;
        loop {
            for brush_y in y - low..y - low + thickness {
                for brush_x in x - low..x - low + thickness {
                    if clip.contains(brush_x, brush_y) {
                        self.set(brush_x, brush_y, color);
                    }
                }
            }
            if (x, y) == to {
                break;
            }
            let doubled = 2 * error;
            if doubled >= dy {
                error += dy;
                x += step_x;
            }
            if doubled <= dx {
                error += dx;
                y += step_y;
            }
        }
    }

    /// Draws `text` with its top-left corner at `(x, y)`, each font pixel `scale` pixels wide.
    pub fn text(&mut self, x: i64, y: i64, text: &str, color: Rgb, scale: i64) {
        for (index, c) in text.chars().enumerate() {
            let origin_x = x + index as i64 * ADVANCE * scale;
            self.glyph(c, scale, color, |column, row| (origin_x + column, y + row));
        }
    }

    /// Draws `text` rotated a quarter turn counter-clockwise (reading bottom to top), with the
    /// bottom-left corner of its first glyph at `(x, y)`.
    pub fn text_vertical(&mut self, x: i64, y: i64, text: &str, color: Rgb, scale: i64) {
        for (index, c) in text.chars().enumerate() {
            let origin_y = y - index as i64 * ADVANCE * scale;
            // Glyph column c goes up from the baseline; glyph row r goes right from x.
            self.glyph(c, scale, color, |column, row| (x + row, origin_y - column));
        }
    }

    /// Plots the scaled pixels of one glyph through `place(column, row) -> (x, y)`, where column
    /// and row are in canvas pixels relative to the glyph's top-left corner.
    fn glyph(&mut self, c: char, scale: i64, color: Rgb, place: impl Fn(i64, i64) -> (i64, i64)) {
        let rows = glyph(c);
        for (row, bits) in (0..GLYPH_HEIGHT).zip(rows) {
            for column in 0..GLYPH_WIDTH {
                if bits & (1 << (GLYPH_WIDTH - 1 - column)) == 0 {
                    continue;
                }
                for sub_y in 0..scale {
                    for sub_x in 0..scale {
                        let (px, py) = place(column * scale + sub_x, row * scale + sub_y);
                        self.set(px, py, color);
                    }
                }
            }
        }
    }

    /// Encodes the canvas as an 8-bit RGB PNG.
    pub fn to_png(&self) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        let mut encoder = png::Encoder::new(&mut bytes, self.width, self.height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&self.pixels)?;
        writer.finish()?;
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WHITE: Rgb = [255, 255, 255];
    const RED: Rgb = [255, 0, 0];

    fn lit(canvas: &Canvas) -> Vec<(i64, i64)> {
        let mut points = Vec::new();
        for y in 0..i64::from(canvas.height()) {
            for x in 0..i64::from(canvas.width()) {
                if canvas.pixel(x, y) != Some(WHITE) {
                    points.push((x, y));
                }
            }
        }
        points
    }

    #[test]
    fn lines_connect_their_endpoints_and_respect_the_clip() {
        let mut canvas = Canvas::new(20, 10, WHITE);
        let all = Rect { left: 0, top: 0, right: 19, bottom: 9 };
        canvas.line((1, 1), (7, 4), RED, 1, all);
        let points = lit(&canvas);
        assert!(points.contains(&(1, 1)) && points.contains(&(7, 4)));
        assert_eq!(points.len(), 7, "one pixel per column of an x-major line: {points:?}");

        let mut canvas = Canvas::new(20, 10, WHITE);
        let clip = Rect { left: 5, top: 0, right: 19, bottom: 9 };
        canvas.line((0, 5), (19, 5), RED, 3, clip);
        let points = lit(&canvas);
        assert_eq!(points.len(), 15 * 3);
        assert!(points.iter().all(|&(x, y)| x >= 5 && (4..=6).contains(&y)));
    }

    #[test]
    fn draws_text_horizontally_and_vertically() {
        let mut canvas = Canvas::new(30, 30, WHITE);
        canvas.text(2, 3, "L", RED, 2);
        // `L` is a vertical bar in column 0 and a bottom row.
        assert_eq!(canvas.pixel(2, 3), Some(RED));
        assert_eq!(canvas.pixel(3, 16), Some(RED));
        assert_eq!(canvas.pixel(11, 16), Some(RED));
        assert_eq!(canvas.pixel(11, 3), Some(WHITE));

        let mut canvas = Canvas::new(30, 30, WHITE);
        canvas.text_vertical(2, 20, "L", RED, 1);
        // Rotated counter-clockwise: the bar lies along the baseline row x = 2.. and the foot
        // of the L runs upward along x = 8.
        let points = lit(&canvas);
        assert_eq!(points.len(), 11);
        assert!(
            points.contains(&(2, 20)) && points.contains(&(8, 20)) && points.contains(&(8, 16))
        );
    }

    #[test]
    fn png_round_trips() {
        let mut canvas = Canvas::new(7, 5, WHITE);
        canvas.set(6, 4, RED);
        canvas.set(99, 99, RED); // outside: ignored
        let bytes = canvas.to_png().unwrap();
        let mut reader = png::Decoder::new(std::io::Cursor::new(bytes)).read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut pixels).unwrap();
        assert_eq!((info.width, info.height, info.color_type), (7, 5, png::ColorType::Rgb));
        assert_eq!(&pixels[..info.buffer_size()], canvas.pixels());
    }
}
