//! The soak plot: a PNG of server RSS, KV pages in use and TTFT p99 over the
//! run's elapsed time, three panels stacked on one time axis, each with a
//! zero-based y axis (so a flat line looks flat and noise is not magnified),
//! tick labels and a dashed line where warm-up ends.
//!
//! Drawn pixel by pixel into an [`RgbImage`] (the `image` crate that
//! `caracal-media` already builds, PNG encoder included) with the 5×7 bitmap
//! font below: no font files, no system libraries.

use std::path::Path;

use anyhow::{bail, Context, Result};
use caracal_media::{Rgb, RgbImage};

/// Width of the PNG in pixels.
pub const PLOT_WIDTH: u32 = 960;
/// Height of the PNG in pixels.
pub const PLOT_HEIGHT: u32 = 720;

/// Left edge of the plot areas (room for the y tick labels).
const LEFT: i64 = 100;
/// Right margin.
const RIGHT: i64 = 24;
/// Top of the first panel's plot area.
const TOP: i64 = 40;
/// Height of one panel's plot area.
const PANEL_H: i64 = 180;
/// Vertical distance between panel tops (plot area + title line).
const PANEL_STEP: i64 = 215;
/// Font scale: each font pixel is this many image pixels.
const SCALE: i64 = 2;

const WHITE: Rgb<u8> = Rgb([255, 255, 255]);
const BLACK: Rgb<u8> = Rgb([0, 0, 0]);
const GRID: Rgb<u8> = Rgb([225, 225, 225]);
const WARMUP: Rgb<u8> = Rgb([150, 150, 150]);

/// One panel: a title and the values of each sample (`None`: not measured).
pub struct Series<'a> {
    /// Title above the panel (drawn in capitals).
    pub title: &'a str,
    /// One value per sample, in the unit the title names.
    pub values: Vec<Option<f64>>,
    /// Line colour.
    pub color: [u8; 3],
    /// A fixed top of the y axis (e.g. the KV pool size), else from the data.
    pub y_max: Option<f64>,
}

/// Draws the panels over `minutes` (the x of every sample) and writes the PNG
/// to `path` (which must end in `.png`). `warmup_min` marks where warm-up ends;
/// `span_min` is the full x range.
pub fn write_png(
    path: &Path,
    minutes: &[f64],
    span_min: f64,
    warmup_min: f64,
    panels: &[Series<'_>],
) -> Result<()> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if !ext.eq_ignore_ascii_case("png") {
        bail!("--plot {} must end in .png", path.display());
    }
    let img = draw(minutes, span_min, warmup_min, panels);
    img.save(path)
        .with_context(|| format!("writing the plot {}", path.display()))
}

/// The image itself (separate from the file for tests).
pub fn draw(minutes: &[f64], span_min: f64, warmup_min: f64, panels: &[Series<'_>]) -> RgbImage {
    let mut c = Canvas(RgbImage::from_pixel(PLOT_WIDTH, PLOT_HEIGHT, WHITE));
    let (x0, x1) = (LEFT, i64::from(PLOT_WIDTH) - RIGHT);
    let span = if span_min > 0.0 { span_min } else { 1.0 };
    let x_step = nice_step(span / 5.0);
    let px = |m: f64| x0 + ((m / span).clamp(0.0, 1.0) * (x1 - x0) as f64).round() as i64;
    for (i, p) in panels.iter().enumerate() {
        let top = TOP + i as i64 * PANEL_STEP;
        let bottom = top + PANEL_H;
        c.text(
            x0,
            top - 10 - 7 * SCALE,
            &p.title.to_ascii_uppercase(),
            BLACK,
        );
        let data_max = p.values.iter().flatten().fold(0.0f64, |a, &b| a.max(b));
        let y_top = match p.y_max {
            Some(m) if m > 0.0 => m,
            _ if data_max > 0.0 => data_max * 1.15,
            _ => 1.0,
        };
        let y_step = nice_step(y_top / 4.0);
        let py = |v: f64| bottom - ((v / y_top).clamp(0.0, 1.0) * PANEL_H as f64).round() as i64;
        // Grid and y ticks.
        let mut v = 0.0;
        while v <= y_top * (1.0 + 1e-9) {
            let y = py(v);
            c.hline(x0, x1, y, GRID);
            let label = tick_label(v, y_step);
            let w = text_width(&label);
            c.text(x0 - 8 - w, y - 7 * SCALE / 2, &label, BLACK);
            v += y_step;
        }
        let mut m = 0.0;
        while m <= span * (1.0 + 1e-9) {
            c.vline(px(m), top, bottom, GRID);
            m += x_step;
        }
        if warmup_min > 0.0 {
            c.dashed_vline(px(warmup_min), top, bottom, WARMUP);
        }
        // The frame.
        c.hline(x0, x1, top, BLACK);
        c.hline(x0, x1, bottom, BLACK);
        c.vline(x0, top, bottom, BLACK);
        c.vline(x1, top, bottom, BLACK);
        // The series: segments between consecutive measured samples, a dot on each.
        let color = Rgb(p.color);
        let pts: Vec<Option<(i64, i64)>> = minutes
            .iter()
            .zip(&p.values)
            .map(|(&m, v)| v.map(|v| (px(m), py(v))))
            .collect();
        for w in pts.windows(2) {
            if let [Some(a), Some(b)] = w {
                c.line(*a, *b, color);
            }
        }
        for &(x, y) in pts.iter().flatten() {
            c.rect(x - 2, y - 2, x + 2, y + 2, color);
        }
    }
    // The x axis of the last panel: ticks and title.
    let bottom = TOP + (panels.len().max(1) as i64 - 1) * PANEL_STEP + PANEL_H;
    let mut m = 0.0;
    while m <= span * (1.0 + 1e-9) {
        let label = tick_label(m, x_step);
        c.vline(px(m), bottom, bottom + 5, BLACK);
        c.text(px(m) - text_width(&label) / 2, bottom + 12, &label, BLACK);
        m += x_step;
    }
    let title = "ELAPSED (MIN); DASHED: END OF WARM-UP";
    c.text(
        (x0 + x1) / 2 - text_width(title) / 2,
        bottom + 12 + 7 * SCALE + 10,
        title,
        BLACK,
    );
    c.0
}

/// A step of 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if raw.is_nan() || raw <= 0.0 || raw.is_infinite() {
        return 1.0;
    }
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|k| k * p)
        .find(|&s| s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * p)
}

/// A tick value with as many decimals as its step needs.
fn tick_label(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{v:.decimals$}")
}

/// Width in pixels of `s` in the font.
fn text_width(s: &str) -> i64 {
    s.chars().count() as i64 * 6 * SCALE - SCALE
}

/// The image with drawing primitives that clip at its edges.
struct Canvas(RgbImage);

impl Canvas {
    fn put(&mut self, x: i64, y: i64, c: Rgb<u8>) {
        if x >= 0 && y >= 0 && x < i64::from(self.0.width()) && y < i64::from(self.0.height()) {
            self.0.put_pixel(x as u32, y as u32, c);
        }
    }

    fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb<u8>) {
        for y in y0..=y1 {
            for x in x0..=x1 {
                self.put(x, y, c);
            }
        }
    }

    fn hline(&mut self, x0: i64, x1: i64, y: i64, c: Rgb<u8>) {
        self.rect(x0, y, x1, y, c);
    }

    fn vline(&mut self, x: i64, y0: i64, y1: i64, c: Rgb<u8>) {
        self.rect(x, y0, x, y1, c);
    }

    fn dashed_vline(&mut self, x: i64, y0: i64, y1: i64, c: Rgb<u8>) {
        for y in (y0..=y1).filter(|y| (y - y0) % 8 < 4) {
            self.rect(x, y, x + 1, y, c);
        }
    }

    /// A two-pixel-wide segment (Bresenham).
    fn line(&mut self, (mut x, mut y): (i64, i64), (x1, y1): (i64, i64), c: Rgb<u8>) {
        let (dx, dy) = ((x1 - x).abs(), -(y1 - y).abs());
        let (sx, sy) = (if x < x1 { 1 } else { -1 }, if y < y1 { 1 } else { -1 });
        let mut err = dx + dy;
        loop {
            self.rect(x, y, x + 1, y + 1, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// `s` with its top-left corner at (x, y); characters the font lacks are blank.
    fn text(&mut self, x: i64, y: i64, s: &str, c: Rgb<u8>) {
        for (i, ch) in s.chars().enumerate() {
            let Some(rows) = glyph(ch) else { continue };
            let gx = x + i as i64 * 6 * SCALE;
            for (r, row) in rows.iter().enumerate() {
                for (col, b) in row.bytes().enumerate() {
                    if b == b'#' {
                        let (px, py) = (gx + col as i64 * SCALE, y + r as i64 * SCALE);
                        self.rect(px, py, px + SCALE - 1, py + SCALE - 1, c);
                    }
                }
            }
        }
    }
}

/// The 5×7 rows of `ch` (letters in capitals), `None` for a space or an
/// unknown character.
fn glyph(ch: char) -> Option<&'static [&'static str; 7]> {
    let ch = ch.to_ascii_uppercase();
    FONT.iter().find(|(c, _)| *c == ch).map(|(_, g)| g)
}

/// A 5×7 bitmap font: capitals, digits and the punctuation the plot uses.
#[rustfmt::skip]
const FONT: &[(char, [&str; 7])] = &[
    ('A', [" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"]),
    ('B', ["#### ", "#   #", "#   #", "#### ", "#   #", "#   #", "#### "]),
    ('C', [" ### ", "#   #", "#    ", "#    ", "#    ", "#   #", " ### "]),
    ('D', ["#### ", "#   #", "#   #", "#   #", "#   #", "#   #", "#### "]),
    ('E', ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"]),
    ('F', ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#    "]),
    ('G', [" ### ", "#   #", "#    ", "# ###", "#   #", "#   #", " ####"]),
    ('H', ["#   #", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"]),
    ('I', [" ### ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "]),
    ('J', ["  ###", "   # ", "   # ", "   # ", "   # ", "#  # ", " ##  "]),
    ('K', ["#   #", "#  # ", "# #  ", "##   ", "# #  ", "#  # ", "#   #"]),
    ('L', ["#    ", "#    ", "#    ", "#    ", "#    ", "#    ", "#####"]),
    ('M', ["#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"]),
    ('N', ["#   #", "#   #", "##  #", "# # #", "#  ##", "#   #", "#   #"]),
    ('O', [" ### ", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "]),
    ('P', ["#### ", "#   #", "#   #", "#### ", "#    ", "#    ", "#    "]),
    ('Q', [" ### ", "#   #", "#   #", "#   #", "# # #", "#  # ", " ## #"]),
    ('R', ["#### ", "#   #", "#   #", "#### ", "# #  ", "#  # ", "#   #"]),
    ('S', [" ####", "#    ", "#    ", " ### ", "    #", "    #", "#### "]),
    ('T', ["#####", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  "]),
    ('U', ["#   #", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "]),
    ('V', ["#   #", "#   #", "#   #", "#   #", "#   #", " # # ", "  #  "]),
    ('W', ["#   #", "#   #", "#   #", "# # #", "# # #", "# # #", " # # "]),
    ('X', ["#   #", "#   #", " # # ", "  #  ", " # # ", "#   #", "#   #"]),
    ('Y', ["#   #", "#   #", " # # ", "  #  ", "  #  ", "  #  ", "  #  "]),
    ('Z', ["#####", "    #", "   # ", "  #  ", " #   ", "#    ", "#####"]),
    ('0', [" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "]),
    ('1', ["  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "]),
    ('2', [" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"]),
    ('3', ["#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "]),
    ('4', ["   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "]),
    ('5', ["#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "]),
    ('6', ["  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "]),
    ('7', ["#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "]),
    ('8', [" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "]),
    ('9', [" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "]),
    ('.', ["     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "]),
    (',', ["     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "]),
    (':', ["     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "]),
    (';', ["     ", " ##  ", " ##  ", "     ", " ##  ", "  #  ", " #   "]),
    ('-', ["     ", "     ", "     ", "#####", "     ", "     ", "     "]),
    ('+', ["     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "]),
    ('=', ["     ", "     ", "#####", "     ", "#####", "     ", "     "]),
    ('(', ["   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "]),
    (')', [" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "]),
    ('/', ["     ", "    #", "   # ", "  #  ", " #   ", "#    ", "     "]),
    ('%', ["##   ", "##  #", "   # ", "  #  ", " #   ", "#  ##", "   ##"]),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn font_rows_are_five_wide() {
        for (c, rows) in FONT {
            assert!(rows.iter().all(|r| r.len() == 5), "{c}");
        }
        assert!(glyph('k').is_some() && glyph(' ').is_none());
    }

    #[test]
    fn nice_steps_and_labels() {
        assert_eq!(nice_step(0.3), 0.5);
        assert_eq!(nice_step(7.0), 10.0);
        assert_eq!(nice_step(1.0), 1.0);
        assert_eq!(nice_step(1700.0), 2000.0);
        assert_eq!(tick_label(1.5, 0.5), "1.5");
        assert_eq!(tick_label(2000.0, 500.0), "2000");
    }

    #[test]
    fn draws_every_panel_and_leaves_gaps_unmeasured() {
        let minutes = [0.25, 0.5, 0.75, 1.0];
        let series = |title, color, values: Vec<Option<f64>>| Series {
            title,
            values,
            color,
            y_max: None,
        };
        let img = draw(
            &minutes,
            1.0,
            0.2,
            &[
                series("rss (mib)", [0, 0, 200], vec![Some(40.0); 4]),
                series(
                    "kv",
                    [200, 0, 0],
                    vec![Some(1.0), None, Some(3.0), Some(2.0)],
                ),
                series("ttft", [0, 150, 0], vec![None; 4]),
            ],
        );
        assert_eq!(img.dimensions(), (PLOT_WIDTH, PLOT_HEIGHT));
        let count = |c: [u8; 3]| img.pixels().filter(|p| p.0 == c).count();
        // A flat series is one horizontal line across three quarters of the axis.
        assert!(count([0, 0, 200]) > 600, "{}", count([0, 0, 200]));
        assert!(count([200, 0, 0]) > 100);
        assert_eq!(count([0, 150, 0]), 0, "nothing measured, nothing drawn");
    }
}
