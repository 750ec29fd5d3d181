//! The styles both screens draw with: bold, dim, the `│` separator, a
//! colour that NO_COLOR turns off, and the colour of a fill level.

use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Span;

pub fn bold() -> Style {
    Style::default().add_modifier(Modifier::BOLD)
}

pub fn dim() -> Style {
    Style::default().add_modifier(Modifier::DIM)
}

pub fn sep() -> Span<'static> {
    Span::styled(" │ ", dim())
}

/// A foreground colour, or none under NO_COLOR.
pub fn fg(no_color: bool, c: Color) -> Style {
    match no_color {
        true => Style::default(),
        false => Style::default().fg(c),
    }
}

/// The colour of a fill level `share` (0..=1) against the level `warn`
/// that warns: red from it, yellow within 15 points under it, green below.
pub fn level_color(share: f64, warn: f64) -> Color {
    if share >= warn {
        Color::Red
    } else if share >= warn - 0.15 {
        Color::Yellow
    } else {
        Color::Green
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_color_drops_the_colour_only() {
        assert_eq!(fg(false, Color::Red).fg, Some(Color::Red));
        assert_eq!(fg(true, Color::Red), Style::default());
        assert_eq!(sep().content, " │ ");
        assert!(bold().add_modifier.contains(Modifier::BOLD));
        assert!(dim().add_modifier.contains(Modifier::DIM));
    }

    #[test]
    fn levels() {
        assert_eq!(level_color(0.95, 0.9), Color::Red);
        assert_eq!(level_color(0.9, 0.9), Color::Red);
        assert_eq!(level_color(0.8, 0.9), Color::Yellow);
        assert_eq!(level_color(0.74, 0.9), Color::Green);
        // --warn-at 50%: yellow from 35%.
        assert_eq!(level_color(0.4, 0.5), Color::Yellow);
        assert_eq!(level_color(0.3, 0.5), Color::Green);
    }
}
