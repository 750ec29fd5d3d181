//! Renders a terminal capture (`tmux capture-pane -e -p`, ANSI colours
//! included) to a PNG, with the DejaVu Sans Mono shipped in assets/fonts
//! (DejaVu Sans for the Braille dots it lacks), each glyph centred in its
//! cell and placed with its own side bearing by memfit's chart typesetter.
//! This is how assets/tui.png, the README's screenshot, is made:
//!
//! ```sh
//! tmux new-session -d -s shot -x 120 -y 40 'memfit tui recipes/quickstart.yaml --out /tmp/shot'
//! sleep 40; tmux capture-pane -e -p -t shot > /tmp/pane.txt
//! cargo run --release --example pane_png -- /tmp/pane.txt assets/tui.png
//! ```

use memfit::sweep::plots::typeset::Typeset;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

const MONO: &[u8] = include_bytes!("../assets/fonts/DejaVuSansMono.ttf");
/// DejaVu Sans Mono has no Braille patterns (ratatui's chart markers); DejaVu Sans does.
const SANS: &[u8] = include_bytes!("../assets/fonts/DejaVuSans.ttf");
/// A cell: DejaVu Sans Mono's advance (0.602 em) and line height (ascent +
/// descent, 1.164 em) at a 13.75 px em, so box-drawing lines join.
const CELL_W: i32 = 8;
const CELL_H: i32 = 16;
/// plotters' text size for that em (its SVG convention: em = size / 1.24).
const FONT_SIZE: f64 = 13.75 * 1.24;
/// Top of the text box below the cell's top, so the baseline (0.76 em below
/// it) sits at the font's ascent (0.928 em).
const TEXT_DY: i32 = 2;
const BG: RGBColor = RGBColor(24, 24, 27);
const FG: RGBColor = RGBColor(220, 220, 220);

/// The 16 basic ANSI colours (xterm's defaults).
fn basic(i: u8) -> RGBColor {
    const T: [(u8, u8, u8); 16] = [
        (0, 0, 0),
        (205, 49, 49),
        (13, 188, 121),
        (229, 229, 16),
        (36, 114, 200),
        (188, 63, 188),
        (17, 168, 205),
        (229, 229, 229),
        (102, 102, 102),
        (241, 76, 76),
        (35, 209, 139),
        (245, 245, 67),
        (59, 142, 234),
        (214, 112, 214),
        (41, 184, 219),
        (255, 255, 255),
    ];
    let (r, g, b) = T[i as usize % 16];
    RGBColor(r, g, b)
}

/// xterm's 256-colour palette.
fn indexed(n: u8) -> RGBColor {
    match n {
        0..=15 => basic(n),
        16..=231 => {
            let n = n - 16;
            let level = |v: u8| if v == 0 { 0 } else { 55 + v * 40 };
            RGBColor(level(n / 36), level((n / 6) % 6), level(n % 6))
        }
        _ => {
            let g = 8 + (n - 232) * 10;
            RGBColor(g, g, g)
        }
    }
}

#[derive(Clone, Copy)]
struct Style {
    fg: RGBColor,
    bg: RGBColor,
    reverse: bool,
}

/// Applies one SGR sequence's parameters.
fn sgr(style: &mut Style, params: &[u16]) {
    let mut i = 0;
    let p = |i: usize| params.get(i).copied().unwrap_or(0);
    if params.is_empty() {
        *style = Style {
            fg: FG,
            bg: BG,
            reverse: false,
        };
    }
    while i < params.len() {
        match p(i) {
            0 => {
                *style = Style {
                    fg: FG,
                    bg: BG,
                    reverse: false,
                }
            }
            7 => style.reverse = true,
            27 => style.reverse = false,
            30..=37 => style.fg = basic((p(i) - 30) as u8),
            90..=97 => style.fg = basic((p(i) - 90 + 8) as u8),
            40..=47 => style.bg = basic((p(i) - 40) as u8),
            100..=107 => style.bg = basic((p(i) - 100 + 8) as u8),
            39 => style.fg = FG,
            49 => style.bg = BG,
            38 | 48 => {
                let which = p(i);
                let (color, skip) = match p(i + 1) {
                    5 => (indexed(p(i + 2) as u8), 2),
                    2 => (RGBColor(p(i + 2) as u8, p(i + 3) as u8, p(i + 4) as u8), 4),
                    _ => (FG, 0),
                };
                if which == 38 {
                    style.fg = color;
                } else {
                    style.bg = color;
                }
                i += 1 + skip;
            }
            _ => {}
        }
        i += 1;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (input, output) = match args.as_slice() {
        [_, i, o] => (i, o),
        _ => {
            eprintln!("usage: pane_png CAPTURE.txt OUT.png");
            std::process::exit(2);
        }
    };
    let text = std::fs::read_to_string(input).unwrap_or_else(|e| {
        eprintln!("cannot read {input}: {e}");
        std::process::exit(2);
    });
    // Cells: (char, style) per row.
    let mut rows: Vec<Vec<(char, Style)>> = Vec::new();
    let mut style = Style {
        fg: FG,
        bg: BG,
        reverse: false,
    };
    for line in text.lines() {
        let mut row = Vec::new();
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' && chars.peek() == Some(&'[') {
                chars.next();
                let mut seq = String::new();
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        if d == 'm' {
                            let params: Vec<u16> = seq
                                .split(';')
                                .filter(|s| !s.is_empty())
                                .filter_map(|s| s.parse().ok())
                                .collect();
                            sgr(&mut style, &params);
                        }
                        break;
                    }
                    seq.push(d);
                }
                continue;
            }
            row.push((c, style));
        }
        rows.push(row);
    }
    let cols = rows.iter().map(Vec::len).max().unwrap_or(1).max(1) as i32;
    let (w, h) = (
        (cols * CELL_W + 16) as u32,
        (rows.len() as i32 * CELL_H + 16) as u32,
    );
    let backend = BitMapBackend::new(output, (w, h));
    let root = Typeset::raster(backend, &[MONO, SANS]).into_drawing_area();
    root.fill(&BG).expect("fill");
    for (r, row) in rows.iter().enumerate() {
        for (c, &(ch, st)) in row.iter().enumerate() {
            let (fg, bg) = if st.reverse {
                (st.bg, st.fg)
            } else {
                (st.fg, st.bg)
            };
            let (x, y) = (8 + c as i32 * CELL_W, 8 + r as i32 * CELL_H);
            if bg != BG {
                root.draw(&Rectangle::new(
                    [(x, y), (x + CELL_W, y + CELL_H)],
                    bg.filled(),
                ))
                .expect("draw");
            }
            if ch != ' ' {
                let font = ("monospace", FONT_SIZE)
                    .into_font()
                    .color(&fg)
                    .pos(Pos::new(HPos::Center, VPos::Top));
                root.draw_text(&ch.to_string(), &font, (x + CELL_W / 2, y + TEXT_DY))
                    .expect("draw text");
            }
        }
    }
    root.present().expect("write png");
    println!("{output}: {w}x{h}");
}
