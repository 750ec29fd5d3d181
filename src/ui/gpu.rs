//! The GPU rows of `memfit watch`'s GPU panel and of `memfit tui`'s
//! (nvitop-style): per GPU its memory as a bar, in IEC units and percent,
//! its utilisation, power and temperature, then a row per process on it.

use ratatui::style::{Color, Modifier};
use ratatui::text::{Line, Span};

use super::style::{bold, dim, fg, level_color};
use super::text::{clip, clip_spans};
use super::widgets::bar_spans;
use crate::telemetry::GpuSample;
use crate::units::{fmt_bytes, percent_of};

/// How the rows are drawn.
#[derive(Clone, Copy, Debug)]
pub struct GpuRows<'a> {
    /// The fill (0..=1) from which a GPU's bar is red ([`level_color`]).
    pub warn_at: f64,
    /// The watched job's processes: marked `job`, in cyan.
    pub job: &'a [u32],
    pub no_color: bool,
}

/// The widest a GPU name's column gets; longer names are cut.
const NAME_W: usize = 22;
/// The narrowest it gets to leave a bar room, and the narrowest bar.
const NAME_MIN: usize = 8;
const BAR_MIN: usize = 4;

/// A GPU row's text around its bar: index and name (in a column `name_w`
/// wide, two spaces after it), memory, the rest.
fn parts(g: &GpuSample, name_w: usize) -> (String, String, String) {
    let mem = format!(
        " {:>10}/{} {:>5.1}%",
        fmt_bytes(g.memory_used_bytes),
        fmt_bytes(g.memory_total_bytes),
        percent_of(g.memory_used_bytes as f64, g.memory_total_bytes)
    );
    let mut rest = match g.utilization_pct {
        Some(u) => format!("  util {u:>3}%"),
        None => "  util   ?".into(),
    };
    if let Some(p) = g.power_w {
        rest += &match g.power_limit_w {
            Some(l) => format!("  {p:>3.0}/{l:.0} W"),
            None => format!("  {p:>3.0} W"),
        };
    }
    if let Some(c) = g.temperature_c {
        rest += &format!("  {c}°C");
    }
    let head = format!("{:>2} {:<name_w$}  ", g.index, clip(&g.name, name_w));
    (head, mem, rest)
}

/// The rows of `gpus` in `width` columns: a row per GPU, its name in a
/// column as wide as the longest (at most 22, and narrower, to 8, where a
/// bar would not fit), its bar as wide as the room left (the same for
/// every GPU, so that the bars line up; 4 to 40 cells, the row's end cut
/// when even 4 do not fit), then a row per process on it.
pub fn gpu_rows(gpus: &[GpuSample], width: usize, o: GpuRows) -> Vec<Line<'static>> {
    // The room a bar has beside the rest of every row, its name column
    // `name_w` wide.
    let room = |name_w: usize| {
        gpus.iter()
            .map(|g| {
                let (head, mem, rest) = parts(g, name_w);
                let err = g.error.as_ref().map_or(0, |e| e.chars().count() + 2);
                width.saturating_sub(
                    head.chars().count() + 2 + mem.chars().count() + rest.chars().count() + err,
                )
            })
            .min()
            .unwrap_or(10)
    };
    // Names give way before the bar does: down to NAME_MIN columns, so
    // that a narrow screen still shows every figure (an 80-column tui).
    let mut name_w = gpus
        .iter()
        .map(|g| g.name.chars().count())
        .max()
        .unwrap_or(0)
        .min(NAME_W);
    while name_w > NAME_MIN && room(name_w) < BAR_MIN {
        name_w -= 1;
    }
    let bar_w = room(name_w).clamp(BAR_MIN, 40);
    let mut out = Vec::new();
    for g in gpus {
        let share = g.memory_used_bytes as f64 / g.memory_total_bytes.max(1) as f64;
        let (head, mem, rest) = parts(g, name_w);
        let mut spans = vec![Span::styled(head, bold()), Span::raw("[")];
        spans.extend(bar_spans(
            share,
            bar_w,
            fg(o.no_color, level_color(share, o.warn_at)),
        ));
        spans.extend([Span::raw("]"), Span::raw(mem), Span::raw(rest)]);
        if let Some(e) = &g.error {
            spans.push(Span::styled(
                format!("  {e}"),
                fg(o.no_color, Color::Red).add_modifier(Modifier::BOLD),
            ));
        }
        out.push(clip_spans(spans, width));
        for p in &g.processes {
            let job = o.job.contains(&p.pid);
            let text = format!(
                "   └ {:>7} {:<16} {:>11}{}",
                p.pid,
                clip(p.name.as_deref().unwrap_or("?"), 16),
                p.used_bytes.map_or("?".into(), fmt_bytes),
                if job { "  job" } else { "" }
            );
            let style = if job {
                fg(o.no_color, Color::Cyan)
            } else {
                dim()
            };
            out.push(Line::from(Span::styled(clip(&text, width), style)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use ratatui::buffer::Buffer;
    use ratatui::layout::Rect;
    use ratatui::widgets::{Paragraph, Widget};

    use super::*;
    use crate::telemetry::ProcSample;
    use crate::ui::testing::rows;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, name: &str, used: u64, procs: &[(u32, u64)]) -> GpuSample {
        GpuSample {
            index,
            name: name.into(),
            memory_used_bytes: used,
            memory_total_bytes: 80 * GIB,
            utilization_pct: Some(97),
            memory_utilization_pct: None,
            power_w: Some(312.0),
            power_limit_w: Some(700.0),
            sm_clock_mhz: None,
            temperature_c: Some(64),
            processes: procs
                .iter()
                .map(|&(pid, b)| ProcSample {
                    pid,
                    used_bytes: Some(b),
                    name: Some("python".into()),
                })
                .collect(),
            error: None,
        }
    }

    fn draw(gpus: &[GpuSample], w: u16, o: GpuRows) -> Buffer {
        let lines = gpu_rows(gpus, w as usize, o);
        let area = Rect::new(0, 0, w, lines.len() as u16);
        let mut buf = Buffer::empty(area);
        Paragraph::new(lines).render(area, &mut buf);
        buf
    }

    const PLAIN: GpuRows = GpuRows {
        warn_at: 0.9,
        job: &[],
        no_color: false,
    };

    #[test]
    fn a_row_per_gpu_and_per_process_the_bars_lined_up() {
        let gpus = [
            gpu(0, "NVIDIA H100 80GB HBM3", 73 * GIB, &[(4242, 69 * GIB)]),
            gpu(1, "H100", 8 * GIB, &[]),
        ];
        let o = GpuRows {
            job: &[4242],
            ..PLAIN
        };
        let buf = draw(&gpus, 100, o);
        let r = rows(&buf);
        assert_eq!(r.len(), 3);
        assert!(r[0].starts_with(" 0 NVIDIA H100 80GB HBM3  ["), "{r:?}");
        assert!(
            r[0].contains("]  73.00 GiB/80.00 GiB  91.2%  util  97%  312/700 W  64°C"),
            "{r:?}"
        );
        assert!(r[1].starts_with("   └    4242 python"), "{r:?}");
        assert!(r[1].trim_end().ends_with("69.00 GiB  job"), "{r:?}");
        assert!(
            r[2].starts_with(&format!(" 1 H100{}[", " ".repeat(17 + 2))),
            "{r:?}"
        );
        // The same bar width on every row: 98 columns less the rest.
        let (open, close) = (r[0].find('[').unwrap(), r[0].find(']').unwrap());
        assert_eq!(
            (r[2].find('[').unwrap(), r[2].find(']').unwrap()),
            (open, close)
        );
        let cells = r[0][open + 1..close].chars().count();
        assert_eq!(cells, 100 - 26 - 2 - 28 - 28);
        // 91% of 16 cells is 15 filled, red (above 90%); 10% is 2, green.
        let x0 = r[0][..open].chars().count() as u16 + 1;
        assert_eq!(buf[(x0, 0)].fg, Color::Red);
        assert_eq!(buf[(x0 + 14, 0)].symbol(), "█");
        assert_eq!(buf[(x0 + 15, 0)].symbol(), "░");
        assert_eq!(buf[(x0 + 1, 2)].fg, Color::Green);
        assert_eq!(buf[(x0 + 2, 2)].symbol(), "░");
        // The job's process in cyan.
        assert_eq!(buf[(5, 1)].fg, Color::Cyan);
    }

    #[test]
    fn the_level_colours_follow_warn_at_and_no_color_drops_them() {
        let g = [gpu(0, "H100", 60 * GIB, &[(7, GIB)])];
        let at = |o: GpuRows| {
            let buf = draw(&g, 80, o);
            let x = rows(&buf)[0].find('[').unwrap() as u16 + 1;
            (buf[(x, 0)].fg, buf[(5, 1)].fg)
        };
        // 75%: green under --warn-at 0.95, yellow under 0.9, red under 0.7.
        for (warn_at, c) in [
            (0.95, Color::Green),
            (0.9, Color::Yellow),
            (0.7, Color::Red),
        ] {
            assert_eq!(at(GpuRows { warn_at, ..PLAIN }).0, c, "{warn_at}");
        }
        let plain = GpuRows {
            no_color: true,
            job: &[7],
            ..PLAIN
        };
        assert_eq!(at(plain), (Color::Reset, Color::Reset));
    }

    #[test]
    fn narrow_rows_keep_a_bar_and_cut_the_end() {
        let mut g = gpu(0, "a GPU with a very long marketing name", 40 * GIB, &[]);
        g.error = Some("GPU is lost".into());
        // The name gives way first, to 8 columns; then the row's end.
        let r = rows(&draw(&[g.clone()], 60, PLAIN));
        assert!(r[0].starts_with(" 0 a GPU w…  [██░░]"), "{r:?}");
        assert!(r[0].ends_with('…'), "{r:?}");
        // An 80-column tui: an H100's row keeps every figure whole.
        let h100 = gpu(0, "NVIDIA H100 80GB HBM3", 73 * GIB, &[]);
        let r = rows(&draw(&[h100], 80, PLAIN));
        assert!(r[0].starts_with(" 0 NVIDIA H100 …  [████]"), "{r:?}");
        assert!(r[0].ends_with("312/700 W  64°C"), "{r:?}");
        let r = rows(&draw(&[g], 200, PLAIN));
        assert!(r[0].trim_end().ends_with("64°C  GPU is lost"), "{r:?}");
        for w in 0..12 {
            gpu_rows(&[gpu(0, "x", GIB, &[(1, GIB)])], w, PLAIN);
        }
    }
}
