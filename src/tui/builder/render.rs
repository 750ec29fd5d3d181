//! Drawing the grid builder: a pure function of the [`Builder`] state.
//!
//! Two header lines (the model, the target and its capacity, whose
//! allocations); the form on the left, the fit map and the selected point's
//! detail on the right; the recommendation, a message line and the key
//! hints at the bottom. Every line fits its width and the form, the map and
//! the detail scroll, so the screen reads at 80x24.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;

use super::compute::{Fit, Planned, fit_of, neighbours};
use super::state::{Builder, Field, Focus, KEYMAP, fields};
use crate::engine::Framework;
use crate::memory::Category;
use crate::plan::{Prediction, Verdict, usd};
use crate::ui::style::{bold, dim};
use crate::ui::text::{clip, clip_spans, wrap_line};
use crate::ui::widgets::panel;

/// A byte size whose number and unit stay together on a wrapped line.
fn fmt_bytes(x: u64) -> String {
    crate::units::fmt_bytes(x).replace(' ', "\u{a0}")
}

/// Columns of the form at 80 wide (wider screens give it more).
const FORM_W: u16 = 36;

pub fn render(b: &Builder, f: &mut Frame) {
    let area = f.area();
    if area.width == 0 || area.height == 0 {
        return;
    }
    let w = area.width as usize;
    let bottom = bottom_lines(b, w);
    let [head, body, foot] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(0),
        Constraint::Length(bottom.len() as u16),
    ])
    .areas(area);
    f.render_widget(Paragraph::new(header_lines(b, w)), head);
    f.render_widget(Paragraph::new(bottom), foot);
    if b.help {
        render_help(b, f, body);
        return;
    }
    let form_w = match body.width {
        x if x >= 120 => 50,
        x if x >= 100 => 44,
        _ => FORM_W.min(body.width / 2),
    };
    let [form, right] =
        Layout::horizontal([Constraint::Length(form_w), Constraint::Min(0)]).areas(body);
    render_form(b, f, form);
    let map_h = (b.map.rows.len() as u16 + 4).clamp(5, (right.height / 2).max(5));
    let [map, detail] =
        Layout::vertical([Constraint::Length(map_h), Constraint::Min(0)]).areas(right);
    render_map(b, f, map);
    render_detail(b, f, detail);
}

fn fg(b: &Builder, c: Color) -> Style {
    crate::ui::style::fg(b.no_color, c)
}

fn fit_style(b: &Builder, fit: Fit) -> Style {
    match fit {
        Fit::Fits => fg(b, Color::Green),
        Fit::Tight => fg(b, Color::Yellow),
        Fit::Over => fg(b, Color::Red),
        Fit::Invalid => dim(),
    }
}

/// Whose allocations a framework's figures are.
pub fn profile_words(f: Framework) -> &'static str {
    match f {
        Framework::Memfit => "memfit engine",
        Framework::HfEager => "your stack: PyTorch + transformers (hf-eager)",
    }
}

fn header_lines(b: &Builder, w: usize) -> Vec<Line<'static>> {
    let r = &b.recipe;
    let Some(p) = &b.planned else {
        return vec![
            Line::from(Span::styled(
                clip(
                    &format!("memfit grid builder │ {} on {}", r.model, r.hardware),
                    w,
                ),
                bold(),
            )),
            Line::from(clip("planning…", w)),
        ];
    };
    let plan = &p.plan;
    let mut first = format!(
        "memfit grid builder │ {} on {} │ {} points planned in {:.1} ms",
        plan.model,
        p.hw.display_name,
        plan.points.len(),
        plan.elapsed_ms
    );
    if first.chars().count() > w {
        first = format!(
            "builder │ {} on {} │ {} points, {:.1} ms",
            plan.model,
            p.hw.display_name,
            plan.points.len(),
            plan.elapsed_ms
        );
    }
    let limit = p.recipe.device.as_ref().and_then(|d| d.limit).is_some();
    let mut fws: Vec<Framework> = plan.points.iter().map(|x| x.point.framework).collect();
    fws.sort_by_key(|f| *f as u8);
    fws.dedup();
    let whose: Vec<&str> = fws.iter().map(|f| profile_words(*f)).collect();
    let cap = fmt_bytes(plan.capacity_bytes);
    let usable = fmt_bytes((plan.capacity_bytes as f64 * (1.0 - plan.headroom)) as u64);
    let source = match limit {
        true => "the run device's limit",
        false => "per GPU",
    };
    let long = format!(
        "capacity {cap} ({source}), usable {usable} at {:.0}% headroom │ allocations: {}",
        plan.headroom * 100.0,
        whose.join(" and ")
    );
    let second = match long.chars().count() <= w {
        true => long,
        false => format!(
            "capacity {cap}{}, usable {usable} │ {}",
            if limit { " (device limit)" } else { "" },
            whose.join(" and ")
        ),
    };
    vec![
        Line::from(Span::styled(clip(&first, w), bold())),
        Line::from(clip(&second, w)),
    ]
}

/// The recommendation (up to two lines), the message or error, the keys.
fn bottom_lines(b: &Builder, w: usize) -> Vec<Line<'static>> {
    let mut out = Vec::new();
    if let Some(p) = &b.planned
        && !b.help
    {
        let line = match &p.plan.recommendation {
            Some(rec) => {
                let x = &p.plan.points[rec.index];
                let why = rec.reasons.first().cloned().unwrap_or_default();
                Line::from(vec![
                    Span::styled("★ recommended: ", bold()),
                    Span::raw(format!(
                        "{} │ ${}/Mtok, {:.0} tokens/s, margin {} │ {why}",
                        x.point.label(),
                        usd(x.usd_per_mtok),
                        x.tokens_per_s,
                        signed(x.margin_bytes)
                    )),
                ])
            }
            None => Line::from(Span::styled(
                "no point of this grid fits: select one (Tab, arrows) for what would make it fit",
                fg(b, Color::Red),
            )),
        };
        out.extend(at_most(wrap_line(&line, w, 2), 2, w));
    }
    if let Some(e) = &b.error {
        let line = Line::from(Span::styled(format!("✗ {e}"), fg(b, Color::Red)));
        out.extend(at_most(wrap_line(&line, w, 2), 2, w));
    }
    if let Some(m) = &b.message {
        out.extend(at_most(wrap_line(&Line::from(m.clone()), w, 2), 3, w));
    }
    let keys = match (b.help, &b.edit) {
        (true, _) => "Esc close  ↑↓ PgUp PgDn scroll",
        (false, Some(_)) => "typing: Enter take  Esc drop  Tab complete a path",
        (false, None) => {
            "? help q quit Tab form/map ␣ toggle e type 1-9 fix r rec w write ⏎ measure"
        }
    };
    out.push(Line::from(Span::styled(clip(keys, w), dim())));
    out
}

/// The first `n` lines; the last of them ends in "…" when more were cut.
fn at_most(mut lines: Vec<Line<'static>>, n: usize, w: usize) -> Vec<Line<'static>> {
    if lines.len() > n {
        lines.truncate(n);
        let last = lines.pop().expect("n > 0");
        let mut cut = clip_spans(last.spans, w.saturating_sub(1));
        cut.spans.push(Span::raw("…"));
        lines.push(cut);
    }
    lines
}

/// `+1.23 GiB` or `-1.23 GiB`.
pub fn signed(x: i64) -> String {
    match x < 0 {
        true => format!("-{}", fmt_bytes(x.unsigned_abs())),
        false => format!("+{}", fmt_bytes(x as u64)),
    }
}

/// The text of a non-axis field.
fn field_value(b: &Builder, f: Field) -> String {
    let r = &b.recipe;
    match f {
        Field::Model => match &b.planned {
            Some(p) if p.recipe.model == r.model => format!(
                "{} ({:.1} M params)",
                r.model,
                p.model.num_parameters() as f64 / 1e6
            ),
            _ => r.model.clone(),
        },
        Field::Hardware => match b.hardware.iter().find(|h| h.profile == r.hardware) {
            Some(h) => h.label.clone(),
            None => r.hardware.clone(),
        },
        Field::Network => match &r.network {
            Some(n) => n.clone(),
            None => "the hardware's own".into(),
        },
        Field::Device => match &r.device {
            Some(d) => d.to_string(),
            None => "cpu (capacity: the GPU's)".into(),
        },
        Field::SeqLen => format!("{} tokens", r.seq_len),
        Field::GlobalBatch => format!("{} sequences", r.global_batch),
        Field::LoraRank => format!("{} (lora/qlora points)", r.lora().rank),
        Field::AttentionKernel => {
            let k = r.attention_kernel.unwrap_or_default();
            match r.grid.attention.iter().any(|a| a.fused()) {
                true => format!("{k} (prices fused points)"),
                false => format!("{k} (no fused point)"),
            }
        }
        Field::Axis(_) => String::new(),
    }
}

fn render_form(b: &Builder, f: &mut Frame, area: Rect) {
    let focus = b.focus == Focus::Form;
    let title = match focus {
        true => "▶ grid (Tab: fit map)",
        false => "grid (Tab: here)",
    };
    let block = panel(title, area);
    let inner = block.inner(area);
    f.render_widget(block, area);
    let w = inner.width as usize;
    if w < 14 || inner.height == 0 {
        return;
    }
    let lab_w = 11;
    let mut lines: Vec<Line<'static>> = Vec::new();
    let (mut sel_first, mut sel_last) = (0, 0);
    for (i, field) in fields(b).into_iter().enumerate() {
        let selected = i == b.field;
        let lab_style = match (selected, focus) {
            (true, true) => bold().add_modifier(Modifier::REVERSED),
            (true, false) => bold(),
            _ => Style::default(),
        };
        let label = Span::styled(format!("{:<lab_w$}", field.label()), lab_style);
        let mut spans: Vec<Span<'static>> = vec![label, Span::raw(" ")];
        match (field, &b.edit) {
            (_, Some(text)) if selected => {
                spans.push(Span::styled(format!("{text}▏"), bold()));
            }
            (Field::Axis(a), _) => {
                let on = a.get(&b.recipe.grid);
                for (k, v) in a.options(&b.recipe.grid).into_iter().enumerate() {
                    let is_on = on.contains(&v);
                    let glyph = if is_on { "●" } else { "○" };
                    let mut st = match is_on {
                        true => fg(b, Color::Cyan).add_modifier(Modifier::BOLD),
                        false => dim(),
                    };
                    if selected && focus && k == b.value {
                        st = st.add_modifier(Modifier::REVERSED);
                    }
                    if k > 0 {
                        spans.push(Span::raw(" "));
                    }
                    spans.push(Span::styled(format!("{glyph}{v}"), st));
                }
                if a == super::axes::Axis::Gpus
                    && let Some(p) = &b.planned
                {
                    spans.push(Span::styled(
                        format!(" ({}/node)", p.hw.gpus_per_node),
                        dim(),
                    ));
                }
            }
            _ => spans.push(Span::raw(field_value(b, field))),
        }
        let wrapped = wrap_line(&Line::from(spans), w, lab_w + 1);
        if selected {
            sel_first = lines.len();
            sel_last = lines.len() + wrapped.len() - 1;
        }
        lines.extend(wrapped);
    }
    let h = inner.height as usize;
    let top = match sel_last >= h {
        true => (sel_last + 1 - h).min(sel_first),
        false => 0,
    };
    let shown: Vec<Line<'static>> = lines.into_iter().skip(top).take(h).collect();
    f.render_widget(Paragraph::new(shown), inner);
}

fn render_map(b: &Builder, f: &mut Frame, area: Rect) {
    let focus = b.focus == Focus::Map;
    let title = match focus {
        true => "▶ fit map: micro-batch →",
        false => "fit map (Tab: here)",
    };
    let block = panel(title, area);
    let inner = block.inner(area);
    f.render_widget(block, area);
    let (w, h) = (inner.width as usize, inner.height as usize);
    let Some(p) = &b.planned else {
        f.render_widget(Paragraph::new("planning…"), inner);
        return;
    };
    if w < 8 || h < 2 {
        return;
    }
    let cell = b
        .map
        .cols
        .iter()
        .map(|c| c.to_string().len())
        .max()
        .unwrap_or(1)
        + 1;
    let lab_w = w.saturating_sub(cell * b.map.cols.len()).max(1);
    let mut lines: Vec<Line<'static>> = Vec::new();
    let mut head = format!("{:<lab_w$}", clip("mb", lab_w));
    for c in &b.map.cols {
        head.push_str(&format!("{c:>cell$}"));
    }
    lines.push(Line::from(Span::styled(clip(&head, w), bold())));
    let rows_h = h.saturating_sub(2).max(1);
    let top = match b.map_row >= rows_h {
        true => b.map_row + 1 - rows_h,
        false => 0,
    };
    for (r, row) in b.map.rows.iter().enumerate().skip(top).take(rows_h) {
        let mut spans = vec![Span::raw(format!(
            "{:<lab_w$}",
            clip(&row.label, lab_w.saturating_sub(1))
        ))];
        for (c, cellv) in row.cells.iter().enumerate() {
            let (glyph, mut st) = match cellv {
                Some(i) => {
                    let fit = fit_of(&p.plan.points[*i]);
                    (fit.glyph(), fit_style(b, fit))
                }
                None => (" ", Style::default()),
            };
            if r == b.map_row && c == b.map_col {
                st = st.add_modifier(Modifier::REVERSED);
                if !focus {
                    st = st.add_modifier(Modifier::DIM);
                }
            }
            spans.push(Span::raw(" ".repeat(cell - 1)));
            spans.push(Span::styled(glyph, st));
        }
        lines.push(clip_spans(spans, w));
    }
    while lines.len() < h - 1 {
        lines.push(Line::default());
    }
    let more = match b.map.rows.len() > rows_h {
        true => format!(
            " │ rows {}-{} of {}",
            top + 1,
            (top + rows_h).min(b.map.rows.len()),
            b.map.rows.len()
        ),
        false => String::new(),
    };
    lines.push(Line::from(Span::styled(
        clip(&format!("● fits ◐ tight ✗ over · invalid{more}"), w),
        dim(),
    )));
    f.render_widget(Paragraph::new(lines), inner);
}

/// Per-category bytes at the moment of the peak, largest first.
fn split_lines(p: &Prediction) -> Vec<String> {
    let Some(split) = p.peak_split.or(p.peak_bytes) else {
        return Vec::new();
    };
    let mut items: Vec<(&str, u64)> = Category::ALL
        .iter()
        .map(|c| (c.name(), split.get(*c)))
        .filter(|(_, v)| *v > 0)
        .collect();
    items.sort_by_key(|x| std::cmp::Reverse(x.1));
    if p.runtime_overhead_bytes > 0 {
        items.push(("runtime overhead", p.runtime_overhead_bytes));
    }
    items
        .into_iter()
        .map(|(n, v)| format!("  {n:<16} {}", fmt_bytes(v)))
        .collect()
}

/// The selected point's detail, as lines before wrapping.
pub fn detail_lines(b: &Builder, p: &Planned, i: usize) -> Vec<Line<'static>> {
    let x = &p.plan.points[i];
    let mut out: Vec<Line<'static>> = Vec::new();
    let fit = fit_of(x);
    out.push(Line::from(Span::styled(x.point.label(), bold())));
    out.push(Line::from(format!(
        "allocations: {}",
        profile_words(x.point.framework)
    )));
    if let Verdict::Invalid { reason } = &x.verdict {
        out.push(Line::from(Span::styled(
            format!("invalid: {reason}"),
            fit_style(b, fit),
        )));
        return out;
    }
    out.push(Line::from(vec![
        Span::styled(
            format!("{} ", fit.word()),
            fit_style(b, fit).add_modifier(Modifier::BOLD),
        ),
        Span::raw(format!(
            "peak {} per GPU, usable {}, margin {}",
            fmt_bytes(x.total_bytes),
            fmt_bytes(x.usable_bytes),
            signed(x.margin_bytes)
        )),
    ]));
    out.extend(split_lines(x).into_iter().map(Line::from));
    if let Some(a) = x.allocator {
        out.push(Line::from(format!(
            "PyTorch caching allocator: allocated {}, reserved {}",
            fmt_bytes(a.max_memory_allocated),
            fmt_bytes(a.max_memory_reserved)
        )));
    }
    if let Some(h) = &x.host {
        out.push(Line::from(format!(
            "host memory per node {} of {} (margin {})",
            fmt_bytes(h.node_bytes),
            fmt_bytes(h.capacity_bytes),
            signed(h.margin_bytes)
        )));
    }
    if let Some(g) = &x.paged {
        out.push(Line::from(format!(
            "paged optimizer state (unified memory, not in the peak) {}: {} on the GPU, {} paged to host ({:.1} ms a step)",
            fmt_bytes(g.bytes),
            fmt_bytes(g.resident_bytes),
            fmt_bytes(g.host_bytes),
            g.seconds_per_step * 1e3
        )));
    }
    let per_node = (p.hw.gpus_per_node as usize).max(1);
    let nodes = x.point.gpus.div_ceil(per_node);
    out.push(Line::from(format!(
        "step {:.1} ms (compute {:.1}, comm {:.1}, offload {:.1} ms) │ {:.0} tokens/s │ ${}/Mtok on {} GPUs ({} node{} of {per_node})",
        x.step_s * 1e3,
        x.compute_s * 1e3,
        x.comm_s * 1e3,
        x.offload_s * 1e3,
        x.tokens_per_s,
        usd(x.usd_per_mtok),
        x.point.gpus,
        nodes,
        if nodes == 1 { "" } else { "s" }
    )));
    if !x.numerics_changes.is_empty() {
        out.push(Line::from(format!(
            "changes numerics: {}{}",
            x.numerics_changes.join(", "),
            if x.excluded {
                " (not recommended: allow_numerics_change is false)"
            } else {
                ""
            }
        )));
    }
    if let Some(rec) = p.plan.recommendation.as_ref().filter(|r| r.index == i) {
        out.push(Line::from(Span::styled("★ recommended:", bold())));
        for why in &rec.reasons {
            out.push(Line::from(format!("  • {why}")));
        }
    }
    let near = neighbours(p, i);
    if !near.is_empty() {
        out.push(Line::from(Span::styled(
            "against its neighbours in the grid:",
            bold(),
        )));
        for n in near {
            let y = &p.plan.points[n.index];
            let text = match (&y.verdict, &x.verdict) {
                (Verdict::Invalid { .. }, _) => "invalid".to_string(),
                _ => {
                    let dt = (y.step_s / x.step_s - 1.0) * 100.0;
                    format!(
                        "{}, {:+.0}% time, ${}/Mtok ({})",
                        signed(y.total_bytes as i64 - x.total_bytes as i64),
                        dt,
                        usd(y.usd_per_mtok),
                        fit_of(y).word()
                    )
                }
            };
            out.push(Line::from(format!(
                "  {} {}: {text}",
                n.axis.key(),
                n.value
            )));
        }
    }
    if x.verdict == Verdict::DoesNotFit {
        out.push(Line::from(Span::styled(
            "what would make it fit (cheapest first; press its number to add it):",
            bold(),
        )));
        match b.current_fixes() {
            None => out.push(Line::from("  planning the changes…")),
            Some([]) => out.push(Line::from(
                "  no single change of a knob or a bigger GPU makes it fit",
            )),
            Some(fixes) => {
                for (k, fix) in fixes.iter().take(9).enumerate() {
                    let what: Vec<String> = fix.changes.iter().map(|c| c.label()).collect();
                    let note = match (fix.in_grid, fix.pred.excluded) {
                        (true, _) => " (in grid)".to_string(),
                        (false, true) => " (changes numerics)".to_string(),
                        _ if fix.capacity != p.plan.capacity_bytes => {
                            format!(" ({} per GPU)", fmt_bytes(fix.capacity))
                        }
                        _ => String::new(),
                    };
                    out.push(Line::from(format!(
                        "  {} {}{note}: peak {}, margin {}, ${}/Mtok",
                        k + 1,
                        what.join(" + "),
                        fmt_bytes(fix.pred.total_bytes),
                        signed(fix.pred.margin_bytes),
                        usd(fix.pred.usd_per_mtok)
                    )));
                }
            }
        }
    }
    out
}

fn render_detail(b: &Builder, f: &mut Frame, area: Rect) {
    let (Some(p), Some(i)) = (&b.planned, b.selected()) else {
        f.render_widget(panel("point", area), area);
        return;
    };
    let block = panel("selected point (PgUp/PgDn scroll)", area);
    let inner = block.inner(area);
    f.render_widget(block, area);
    let w = inner.width as usize;
    let lines: Vec<Line<'static>> = detail_lines(b, p, i)
        .iter()
        .flat_map(|l| wrap_line(l, w, 4))
        .collect();
    let h = inner.height as usize;
    let top = (b.scroll as usize).min(lines.len().saturating_sub(h));
    let shown: Vec<Line<'static>> = lines.into_iter().skip(top).take(h).collect();
    f.render_widget(Paragraph::new(shown), inner);
}

fn render_help(b: &Builder, f: &mut Frame, area: Rect) {
    let inner_w = area.width.saturating_sub(2) as usize;
    let mut lines: Vec<Line<'static>> = Vec::new();
    for (k, what) in KEYMAP {
        let l = Line::from(vec![
            Span::styled(format!("{k:<15}"), bold()),
            Span::raw(what.to_string()),
        ]);
        lines.extend(wrap_line(&l, inner_w, 15));
    }
    for text in [
        "",
        "Every key re-plans the grid on the meta engine (memfit plan's planner) and redraws the fit map: a row per knob combination, a column per micro-batch; ● fits with at least a tenth of the usable memory to spare, ◐ fits tighter than that (or within the PyTorch allocator's fragmentation), ✗ over, · invalid.",
        "Figures are per GPU, in IEC units, and belong to the allocation profile the point names: memfit engine (what memfit's own engine holds) or hf-eager (what PyTorch + transformers hold).",
        "margin = usable - peak, where usable = capacity x (1 - headroom).",
    ] {
        lines.extend(wrap_line(&Line::from(text.to_string()), inner_w, 0));
    }
    let h = area.height.saturating_sub(2) as usize;
    let n = lines.len();
    let top = (b.help_scroll as usize).min(n.saturating_sub(h));
    let end = (top + h).min(n);
    // The border says where the page is, and whether there is more.
    let more = match (top > 0, end < n) {
        (_, true) => " ↓ more",
        (true, false) => " end",
        (false, false) => "",
    };
    let block = panel("help: grid builder", area).title_bottom(clip(
        &format!("lines {}-{end} of {n}{more}", top + 1),
        inner_w,
    ));
    let inner = block.inner(area);
    f.render_widget(block, area);
    let shown: Vec<Line<'static>> = lines.into_iter().skip(top).take(h).collect();
    f.render_widget(Paragraph::new(shown), inner);
}
