//! Text for bitmap charts, laid out and rasterised here with ab_glyph.
//!
//! plotters 0.3.7 draws ab_glyph text (`FontDataInternal::draw`) by placing
//! each glyph's coverage bitmap at the pen position without the glyph's left
//! side bearing (the outlined glyph's `px_bounds().min.x`), and truncates the
//! pen and each glyph's vertical offset toward zero (`as i32`). Glyphs with
//! a wide bearing ('p', '.', digits) land flush against their predecessor
//! and leave the bearing as a gap after them ("cap acity", "fp 32"), and a
//! glyph whose top lies below the text's midline (the period) lands a pixel
//! above the others' baseline ("24· 00 MiB"). The font file and the sizes
//! are fine; the placement is not.
//!
//! [`Typeset`] wraps a drawing backend and draws text itself: each glyph at
//! its pen position with its own bearing, advances and kerning in
//! fractional pixels, on one baseline, coverage merged per text and blended
//! once. Everything else is passed through. The metrics follow plotters'
//! SVG backend (font-size = size / 1.24; anchors at `0.76em` for top,
//! `0.5ex` for centre), so a chart renders the same as PNG and as SVG in a
//! browser that has the font. With `raster` off (SVG), text is still
//! written as `<text>` by the inner backend; only the size estimate comes
//! from here.

use ab_glyph::{Font, FontRef, GlyphId, PxScale, ScaleFont, point};
use plotters::prelude::DrawingBackend;
use plotters_backend::text_anchor::{HPos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingErrorKind,
};

/// plotters' SVG backend writes `font-size = size / 1.24`: the em in pixels.
const SVG_EM_PER_SIZE: f64 = 1.0 / 1.24;

/// Where text would land: glyph positions and the advance width, in pixels,
/// relative to the pen's start on the baseline.
struct Line<'f> {
    glyphs: Vec<(&'f FontRef<'static>, PxScale, GlyphId, f32)>,
    width: f32,
}

/// A backend whose text is drawn by ab_glyph with correct glyph placement.
pub struct Typeset<DB> {
    inner: DB,
    /// Rasterise text here (bitmaps); else hand it to the inner backend (SVG).
    raster: bool,
    /// The first font is used for every family; later ones supply glyphs the
    /// first lacks (DejaVu Sans Mono has no Braille, DejaVu Sans does).
    fonts: Vec<FontRef<'static>>,
}

impl<DB: DrawingBackend> Typeset<DB> {
    /// Text rasterised with `fonts` (TrueType/OpenType files, first one
    /// preferred). Fonts that do not parse are skipped.
    pub fn raster(inner: DB, fonts: &[&'static [u8]]) -> Self {
        Self::new(inner, true, fonts)
    }

    /// Text left to the inner backend (SVG `<text>`), measured with `fonts`.
    pub fn measure_only(inner: DB, fonts: &[&'static [u8]]) -> Self {
        Self::new(inner, false, fonts)
    }

    fn new(inner: DB, raster: bool, fonts: &[&'static [u8]]) -> Self {
        Typeset {
            inner,
            raster,
            fonts: fonts
                .iter()
                .filter_map(|b| FontRef::try_from_slice(b).ok())
                .collect(),
        }
    }

    /// The em of a plotters text size, in pixels.
    fn em(size: f64) -> f32 {
        (size * SVG_EM_PER_SIZE) as f32
    }

    /// The ab_glyph scale (ascent - descent in pixels) giving `em`.
    fn scale(font: &FontRef<'static>, em: f32) -> PxScale {
        let upem = font.units_per_em().unwrap_or(1000.0);
        PxScale::from(em * font.height_unscaled() / upem)
    }

    /// The first font with a glyph for `c` (the first font's notdef if none).
    fn font_for(&self, c: char) -> Option<(&FontRef<'static>, GlyphId)> {
        self.fonts
            .iter()
            .map(|f| (f, f.glyph_id(c)))
            .find(|(_, id)| id.0 != 0)
            .or_else(|| self.fonts.first().map(|f| (f, f.glyph_id(c))))
    }

    fn layout(&self, text: &str, em: f32) -> Line<'_> {
        let mut glyphs = Vec::with_capacity(text.len());
        let mut pen = 0f32;
        let mut prev: Option<(&FontRef<'static>, GlyphId)> = None;
        for c in text.chars() {
            let Some((font, id)) = self.font_for(c) else {
                continue;
            };
            let scale = Self::scale(font, em);
            let scaled = font.as_scaled(scale);
            if let Some((pf, pid)) = prev
                && std::ptr::eq(pf, font)
            {
                pen += scaled.kern(pid, id);
            }
            glyphs.push((font, scale, id, pen));
            pen += scaled.h_advance(id);
            prev = Some((font, id));
        }
        Line { glyphs, width: pen }
    }

    /// The x-height in pixels (SVG's `ex`), from the first font's 'x'.
    fn ex(&self, em: f32) -> f32 {
        self.fonts
            .first()
            .and_then(|f| {
                let upem = f.units_per_em()?;
                let x = f.outline(f.glyph_id('x'))?;
                Some(x.bounds.max.y / upem * em)
            })
            .unwrap_or(0.5 * em)
    }

    /// Text width and height in pixels, as plotters' layout expects them.
    pub fn measure(&self, text: &str, size: f64) -> (u32, u32) {
        let em = Self::em(size);
        let line = self.layout(text, em);
        (line.width.ceil().max(0.0) as u32, em.round() as u32)
    }

    fn rasterise<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<DB::ErrorType>> {
        let color = style.color();
        let em = Self::em(style.size());
        let line = self.layout(text, em);
        let anchor = style.anchor();
        let x0 = match anchor.h_pos {
            HPos::Left => 0.0,
            HPos::Center => -line.width / 2.0,
            HPos::Right => -line.width,
        };
        let baseline = match anchor.v_pos {
            VPos::Top => 0.76 * em,
            VPos::Center => 0.5 * self.ex(em),
            VPos::Bottom => -0.5 * self.ex(em),
        };
        // Coverage of the whole text, so overlapping glyph edges blend once.
        let outlined: Vec<_> = line
            .glyphs
            .iter()
            .filter_map(|&(font, scale, id, pen)| {
                font.outline_glyph(id.with_scale_and_position(scale, point(x0 + pen, baseline)))
            })
            .collect();
        let Some(first) = outlined.first() else {
            return Ok(());
        };
        let (mut lo, mut hi) = (first.px_bounds().min, first.px_bounds().max);
        for g in &outlined {
            let b = g.px_bounds();
            lo = point(lo.x.min(b.min.x), lo.y.min(b.min.y));
            hi = point(hi.x.max(b.max.x), hi.y.max(b.max.y));
        }
        let (bx, by) = (lo.x as i32, lo.y as i32);
        let w = (hi.x - lo.x) as usize + 1;
        let h = (hi.y - lo.y) as usize + 1;
        let mut cover = vec![0f32; w * h];
        for g in &outlined {
            let b = g.px_bounds();
            let (gx, gy) = (b.min.x as i32 - bx, b.min.y as i32 - by);
            g.draw(|x, y, c| {
                let (x, y) = (gx + x as i32, gy + y as i32);
                if x >= 0 && y >= 0 && (x as usize) < w && (y as usize) < h {
                    let cell = &mut cover[y as usize * w + x as usize];
                    *cell = (*cell + c).min(1.0);
                }
            });
        }
        let trans = style.transform();
        let (cw, ch) = self.inner.get_size();
        for (i, &c) in cover.iter().enumerate() {
            if c <= 0.0 {
                continue;
            }
            let (x, y) = (bx + (i % w) as i32, by + (i / w) as i32);
            let (x, y) = trans.transform(x, y);
            let (x, y) = (pos.0 + x, pos.1 + y);
            if x < 0 || y < 0 || x >= cw as i32 || y >= ch as i32 {
                continue;
            }
            self.inner.draw_pixel(
                (x, y),
                BackendColor {
                    alpha: color.alpha * f64::from(c),
                    rgb: color.rgb,
                },
            )?;
        }
        Ok(())
    }
}

impl<DB: DrawingBackend> DrawingBackend for Typeset<DB> {
    type ErrorType = DB::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.ensure_prepared()
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.present()
    }

    fn draw_pixel(
        &mut self,
        point: BackendCoord,
        color: BackendColor,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_pixel(point, color)
    }

    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_line(from, to, style)
    }

    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_rect(upper_left, bottom_right, style, fill)
    }

    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_path(path, style)
    }

    fn draw_circle<S: BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_circle(center, radius, style, fill)
    }

    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.fill_polygon(vert, style)
    }

    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        if style.color().alpha == 0.0 {
            return Ok(());
        }
        if self.raster && !self.fonts.is_empty() {
            self.rasterise(text, style, pos)
        } else {
            self.inner.draw_text(text, style, pos)
        }
    }

    fn estimate_text_size<S: BackendTextStyle>(
        &self,
        text: &str,
        style: &S,
    ) -> Result<(u32, u32), DrawingErrorKind<Self::ErrorType>> {
        if self.fonts.is_empty() {
            return self.inner.estimate_text_size(text, style);
        }
        Ok(self.measure(text, style.size()))
    }

    fn blit_bitmap(
        &mut self,
        pos: BackendCoord,
        size: (u32, u32),
        src: &[u8],
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.blit_bitmap(pos, size, src)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plotters::prelude::*;

    static SANS: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");

    /// Renders `text` left/top-anchored at (10, 10); returns the inked
    /// columns as runs (first, last) and each run's lowest inked row.
    fn render(text: &str, size: u32) -> Vec<(usize, usize, usize)> {
        let (w, h) = (600usize, 90usize);
        let mut buf = vec![255u8; w * h * 3];
        {
            let backend = BitMapBackend::with_buffer(&mut buf, (w as u32, h as u32));
            let root = Typeset::raster(backend, &[SANS]).into_drawing_area();
            let style = ("sans-serif", size).into_font().color(&BLACK);
            root.draw_text(text, &style, (10, 10)).unwrap();
            root.present().unwrap();
        }
        let ink = |x: usize, y: usize| buf[(y * w + x) * 3] < 230;
        let mut runs = Vec::new();
        let mut start = None;
        for x in 0..=w {
            let inked = x < w && (0..h).any(|y| ink(x, y));
            match (inked, start) {
                (true, None) => start = Some(x),
                (false, Some(s)) => {
                    let bottom = (0..h).filter(|&y| (s..x).any(|x| ink(x, y))).max().unwrap();
                    runs.push((s, x - 1, bottom));
                    start = None;
                }
                _ => {}
            }
        }
        runs
    }

    /// Regression: plotters' own ab_glyph drawing put each glyph at its pen
    /// without its left side bearing ("cap acity"), and truncated the
    /// vertical offset toward zero, so a period rode a pixel above the
    /// digits' baseline ("24· 00"). Each glyph's ink now starts at its pen
    /// plus its bearing, and glyphs share one baseline.
    #[test]
    fn glyphs_start_at_pen_plus_bearing_on_one_baseline() {
        let font = FontRef::try_from_slice(SANS).unwrap();
        let size = 40u32;
        let em = size as f32 / 1.24;
        let scaled = font.as_scaled(PxScale::from(
            em * font.height_unscaled() / font.units_per_em().unwrap(),
        ));
        let text = "24.00";
        let runs = render(text, size);
        assert_eq!(runs.len(), 5, "{runs:?}");
        let mut pen = 10.0f32;
        let mut prev = None;
        for (c, run) in text.chars().zip(&runs) {
            let id = scaled.glyph_id(c);
            if let Some(p) = prev {
                pen += scaled.kern(p, id);
            }
            let left = pen + scaled.h_side_bearing(id);
            assert!(
                (run.0 as f32 - left).abs() <= 1.0,
                "{c:?} inked from x={} but its bearing puts it at {left:.1}",
                run.0
            );
            pen += scaled.h_advance(id);
            prev = Some(id);
        }

        // At chart sizes the period sits on the digits' baseline.
        for size in [13, 14, 15, 16] {
            let runs = render("2.2", size);
            assert_eq!(runs.len(), 3, "{runs:?}");
            assert_eq!(runs[1].2, runs[0].2, "size {size}: period off the baseline");
        }
    }

    #[test]
    fn width_is_the_advance_sum() {
        let mut svg = String::new();
        let t = Typeset::measure_only(SVGBackend::with_string(&mut svg, (10, 10)), &[SANS]);
        let (w, h) = t.measure("capacity", 24.0);
        // DejaVu Sans: "capacity" advances to about 4.5 em.
        let em = 24.0 / 1.24;
        assert!((w as f64 / em - 4.5).abs() < 0.3, "{w} px for {em} px em");
        assert_eq!(h, em.round() as u32);
        // DejaVu Sans has Braille (ratatui's chart dots), with an advance.
        assert!(t.measure("\u{2800}", 24.0).0 > 0);
    }
}
