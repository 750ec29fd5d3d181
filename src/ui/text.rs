//! Text that fits a width: clipping with "…", word-wrapping, and the
//! clock both screens show.

use ratatui::style::Style;
use ratatui::text::{Line, Span};

/// Word-wraps a styled line into lines of at most `width` columns, each
/// after the first indented by `hang`. A word longer than a line is cut
/// where the line ends; a non-breaking space keeps a figure with its unit.
pub fn wrap_line(line: &Line<'static>, width: usize, hang: usize) -> Vec<Line<'static>> {
    if width == 0 {
        return vec![Line::default()];
    }
    let hang = hang.min(width / 2);
    // Runs of spaces and of anything else, each with its span's style.
    let mut tokens: Vec<(String, Style, bool)> = Vec::new();
    for s in &line.spans {
        let style = line.style.patch(s.style);
        let mut cur = String::new();
        let mut space = false;
        for c in s.content.chars() {
            let is_space = c == ' ';
            if !cur.is_empty() && is_space != space {
                tokens.push((std::mem::take(&mut cur), style, space));
            }
            space = is_space;
            cur.push(c);
        }
        if !cur.is_empty() {
            tokens.push((cur, style, space));
        }
    }
    let mut out: Vec<Line<'static>> = Vec::new();
    let mut cur: Vec<Span<'static>> = Vec::new();
    let mut used = 0;
    // Where the current line's text starts (past its indent).
    let mut start = 0;
    let mut pending: Option<(String, Style)> = None;
    for (text, style, space) in tokens {
        if space {
            // Spaces at the start of a continuation line are dropped.
            if used > start || out.is_empty() {
                let p = pending.get_or_insert((String::new(), style));
                p.0 += &text;
            }
            continue;
        }
        let mut word: Vec<char> = text.chars().collect();
        let pad = pending.as_ref().map_or(0, |p| p.0.chars().count());
        if used + pad + word.len() > width && used > start {
            out.push(Line::from(std::mem::take(&mut cur)));
            cur.push(Span::raw(" ".repeat(hang)));
            used = hang;
            start = hang;
            pending = None;
        }
        if let Some((p, st)) = pending.take() {
            let n = p.chars().count().min(width - used);
            cur.push(Span::styled(p.chars().take(n).collect::<String>(), st));
            used += n;
        }
        // A word longer than what is left: as much as fits, the rest on
        // the next lines.
        while used + word.len() > width {
            let room = width - used;
            if room > 0 {
                cur.push(Span::styled(word[..room].iter().collect::<String>(), style));
                word.drain(..room);
            }
            out.push(Line::from(std::mem::take(&mut cur)));
            cur.push(Span::raw(" ".repeat(hang)));
            used = hang;
            start = hang;
        }
        used += word.len();
        cur.push(Span::styled(word.into_iter().collect::<String>(), style));
    }
    if used > start || out.is_empty() {
        out.push(Line::from(cur));
    }
    out
}

/// `s` in at most `w` columns, cut with "…" when longer.
pub fn clip(s: &str, w: usize) -> String {
    if s.chars().count() <= w {
        return s.to_string();
    }
    if w == 0 {
        return String::new();
    }
    let mut out: String = s.chars().take(w - 1).collect();
    out.push('…');
    out
}

/// Spans in at most `width` columns: those that fit, the first that does
/// not cut with "…", none after it.
pub fn clip_spans(spans: Vec<Span<'static>>, width: usize) -> Line<'static> {
    let mut left = width;
    let mut out = Vec::new();
    for s in spans {
        let n = s.content.chars().count();
        if n <= left {
            left -= n;
            out.push(s);
        } else {
            out.push(Span::styled(clip(&s.content, left), s.style));
            break;
        }
    }
    Line::from(out)
}

/// The columns `spans` take.
pub fn spans_width(spans: &[Span]) -> usize {
    spans.iter().map(|s| s.content.chars().count()).sum()
}

/// `h:mm:ss`, or `m:ss` under an hour.
pub fn fmt_elapsed(s: f64) -> String {
    let t = s.max(0.0) as u64;
    let (h, m, s) = (t / 3600, t / 60 % 60, t % 60);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

#[cfg(test)]
mod tests {
    use ratatui::buffer::Buffer;
    use ratatui::layout::Rect;
    use ratatui::style::Modifier;

    use super::*;
    use crate::ui::testing::rows;

    #[test]
    fn clip_cuts_with_an_ellipsis() {
        assert_eq!(clip("abcdef", 4), "abc…");
        assert_eq!(clip("abc", 3), "abc");
        assert_eq!(clip("abc", 0), "");
        assert_eq!(clip("→→→", 2), "→…");
    }

    #[test]
    fn clip_spans_keeps_styles_and_drops_what_is_past_the_cut() {
        let bold = Style::default().add_modifier(Modifier::BOLD);
        let line = clip_spans(
            vec![Span::styled("ab", bold), Span::raw("cdef"), Span::raw("gh")],
            5,
        );
        assert_eq!(line.to_string(), "abcd…");
        assert_eq!(line.spans.len(), 2);
        assert_eq!(line.spans[0].style, bold);
        assert_eq!(spans_width(&line.spans), 5);
        let area = Rect::new(0, 0, 6, 1);
        let mut buf = Buffer::empty(area);
        buf.set_line(0, 0, &line, 6);
        assert_eq!(rows(&buf), ["abcd… "]);
        assert!(buf[(1, 0)].modifier.contains(Modifier::BOLD));
        assert!(!buf[(2, 0)].modifier.contains(Modifier::BOLD));
    }

    #[test]
    fn wrap_line_hangs_continuations_and_keeps_a_figure_whole() {
        let line = Line::from("peak 1.00\u{a0}GiB over the limit");
        let text: Vec<String> = wrap_line(&line, 12, 2)
            .iter()
            .map(|l| l.to_string().replace('\u{a0}', " "))
            .collect();
        assert_eq!(text, ["peak", "  1.00 GiB", "  over the", "  limit"]);
        // A word longer than a line is cut where the line ends.
        let text: Vec<String> = wrap_line(&Line::from("abcdefgh"), 3, 0)
            .iter()
            .map(|l| l.to_string())
            .collect();
        assert_eq!(text, ["abc", "def", "gh"]);
        assert_eq!(wrap_line(&line, 0, 0).len(), 1);
    }

    #[test]
    fn elapsed() {
        assert_eq!(fmt_elapsed(83.0), "1:23");
        assert_eq!(fmt_elapsed(3723.0), "1:02:03");
        assert_eq!(fmt_elapsed(-4.0), "0:00");
    }
}
