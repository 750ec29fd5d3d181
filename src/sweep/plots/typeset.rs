//! Text for bitmap charts, laid out and rasterised here with ab_glyph.
//!
//! plotters 0.3.7 draws ab_glyph text by placing each glyph's coverage
//! bitmap at the pen position, without the glyph's left side bearing (the
//! `px_bounds().min.x` of the outlined glyph), and moves the pen in whole
//! pixels. A glyph that sits right of its origin ('a', '.', '0' ...) is
//! drawn flush against its predecessor and leaves its bearing as a gap after
//! it: "cap acity", "fp 32", "24· 00 MiB". The font file and the sizes are
//! fine; the layout is not.
//!
//! [`Typeset`] wraps a drawing backend and draws text itself: each glyph at
//! its pen position plus its own bearing, advances and kerning in fractional
//! pixels, coverage merged per text and blended once. Everything else is
//! passed through. The metrics follow plotters' SVG backend (font-size =
//! size / 1.24; anchors at `0.76em` for top, `0.5ex` for centre), so a chart
//! renders the same as PNG and as SVG in a browser that has the font. With
//! `raster` off (SVG), text is still written as `<text>` by the inner
//! backend; only the size estimate comes from here.

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

    /// Columns of a rendered word that hold ink, as runs: (first, last).
    fn ink_runs(text: &str) -> Vec<(usize, usize)> {
        let (w, h) = (400u32, 40u32);
        let mut buf = vec![255u8; (w * h * 3) as usize];
        {
            let backend = BitMapBackend::with_buffer(&mut buf, (w, h));
            let _ = plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, SANS); let root = backend.into_drawing_area();
            root.draw_text(text, &("sans-serif", 24).into_font().color(&BLACK), (4, 4))
                .unwrap();
            root.present().unwrap();
        }
        let inked: Vec<bool> = (0..w as usize)
            .map(|x| (0..h as usize).any(|y| buf[(y * w as usize + x) * 3] < 160))
            .collect();
        let mut runs = Vec::new();
        let mut start = None;
        for (x, &ink) in inked.iter().chain([&false]).enumerate() {
            match (ink, start) {
                (true, None) => start = Some(x),
                (false, Some(s)) => {
                    runs.push((s, x - 1));
                    start = None;
                }
                _ => {}
            }
        }
        runs
    }

    /// Regression: "capacity" rendered as "cap acity" and "24.00" as
    /// "24· 00" because each glyph lost its left side bearing. Letter gaps
    /// within a word are now even: no gap is more than a few pixels wider
    /// than the narrowest.
    #[test]
    fn letters_keep_their_side_bearings() {
        for word in ["capacity", "24.00", "fp32"] {
            let runs = ink_runs(word);
            let gaps: Vec<usize> = runs.windows(2).map(|r| r[1].0 - r[0].1 - 1).collect();
            let widest = gaps.iter().max().copied().unwrap_or(0);
            eprintln!("{word}: gaps {gaps:?} runs {runs:?}");
            assert!(widest <= 4, "{word}: uneven gaps {gaps:?} (runs {runs:?})");
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
