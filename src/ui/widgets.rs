//! The small widgets both screens draw: a titled panel, a fill bar, the
//! footer of key hints.

use ratatui::layout::Rect;
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::Block;

use super::style::{bold, dim};
use super::text::{clip, clip_spans};

/// A bordered block whose title is cut to the block's width.
pub fn panel(title: &str, area: Rect) -> Block<'static> {
    Block::bordered().title(clip(title, area.width.saturating_sub(2) as usize))
}

/// A memory bar `████░░░░` of `width` cells for `share` in 0..=1.
pub fn bar(share: f64, width: usize) -> String {
    let full = ((share.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!("{}{}", "█".repeat(full), "░".repeat(width - full))
}

/// [`bar`] as spans: the filled cells in `fill`, the empty ones dim.
pub fn bar_spans(share: f64, width: usize, fill: Style) -> Vec<Span<'static>> {
    let text = bar(share, width);
    let full = text.chars().take_while(|&c| c == '█').count();
    let (filled, empty) = text.split_at(full * '█'.len_utf8());
    vec![
        Span::styled(filled.to_string(), fill),
        Span::styled(empty.to_string(), dim()),
    ]
}

/// A key hint: the key, what it does, and the shorter key and word the
/// compact footer uses.
pub struct Hint {
    key: &'static str,
    what: &'static str,
    short_key: &'static str,
    short: &'static str,
}

pub const fn hint(
    key: &'static str,
    what: &'static str,
    short_key: &'static str,
    short: &'static str,
) -> Hint {
    Hint {
        key,
        what,
        short_key,
        short,
    }
}

/// The key hints in `width` columns: every one, spelled out, when that
/// fits; else compact (short keys in bold, one space apart), as many as
/// fit in order of need. The first always shows.
pub fn hints(items: &[Hint], width: usize) -> Line<'static> {
    let full: Vec<String> = items
        .iter()
        .map(|h| format!("{} {}", h.key, h.what))
        .collect();
    let line = full.join(" · ");
    if line.chars().count() <= width {
        return Line::from(Span::styled(line, dim()));
    }
    let mut spans = Vec::new();
    let mut used = 0;
    for (i, h) in items.iter().enumerate() {
        let gap = usize::from(i > 0);
        let n = gap + h.short_key.chars().count() + 1 + h.short.chars().count();
        if i > 0 && used + n > width {
            break;
        }
        if i > 0 {
            spans.push(Span::raw(" "));
        }
        spans.push(Span::styled(h.short_key, bold()));
        spans.push(Span::styled(format!(" {}", h.short), dim()));
        used += n;
    }
    clip_spans(spans, width)
}

#[cfg(test)]
mod tests {
    use ratatui::buffer::Buffer;
    use ratatui::style::{Color, Modifier};
    use ratatui::widgets::{Paragraph, Widget};

    use super::*;
    use crate::ui::testing::rows;

    #[test]
    fn a_panel_is_bordered_and_its_title_cut_to_fit() {
        let area = Rect::new(0, 0, 10, 3);
        let mut buf = Buffer::empty(area);
        Paragraph::new("x")
            .block(panel("a long title", area))
            .render(area, &mut buf);
        assert_eq!(rows(&buf), ["┌a long …┐", "│x       │", "└────────┘"]);
    }

    #[test]
    fn bars_fill_to_their_share() {
        assert_eq!(bar(0.5, 4), "██░░");
        assert_eq!(bar(2.0, 3), "███");
        assert_eq!(bar(-1.0, 2), "░░");
        assert_eq!(bar(0.5, 0), "");
        let fill = Style::default().fg(Color::Cyan);
        let area = Rect::new(0, 0, 8, 1);
        let mut buf = Buffer::empty(area);
        buf.set_line(0, 0, &Line::from(bar_spans(0.25, 8, fill)), 8);
        assert_eq!(rows(&buf), ["██░░░░░░"]);
        assert_eq!(buf[(1, 0)].fg, Color::Cyan);
        assert_eq!(buf[(2, 0)].fg, Color::Reset);
        assert!(buf[(2, 0)].modifier.contains(Modifier::DIM));
    }

    const KEYS: &[Hint] = &[
        hint("?", "help", "?", "help"),
        hint("q", "quit", "q", "quit"),
        hint("Enter", "detail", "⏎", "detail"),
    ];

    fn drawn(width: u16) -> Buffer {
        let area = Rect::new(0, 0, width, 1);
        let mut buf = Buffer::empty(area);
        buf.set_line(0, 0, &hints(KEYS, width as usize), width);
        buf
    }

    #[test]
    fn hints_spell_out_when_they_fit_else_shorten_in_order_of_need() {
        let buf = drawn(30);
        assert_eq!(rows(&buf), ["? help · q quit · Enter detail"]);
        assert!(buf[(0, 0)].modifier.contains(Modifier::DIM));
        // Compact: short keys in bold, as many as fit, whole.
        let buf = drawn(20);
        assert_eq!(rows(&buf), ["? help q quit       "]);
        assert!(buf[(0, 0)].modifier.contains(Modifier::BOLD));
        assert!(buf[(2, 0)].modifier.contains(Modifier::DIM));
        assert_eq!(rows(&drawn(22)), ["? help q quit ⏎ detail"]);
        // The first always shows, cut when it must be.
        assert_eq!(rows(&drawn(4)), ["? h…"]);
    }
}
