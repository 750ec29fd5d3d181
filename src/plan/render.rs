//! The plan as a terminal table and as Markdown (JSON is the `Plan` itself).
//!
//! The terminal table fits a width ([`terminal_width`]): a knob that is the
//! same at every point is said once above the table instead of in a column
//! (as the HTML sweep report does); when the rest is still too wide, the
//! columns that matter least are hidden and named under the table; and the
//! prose around it is wrapped. `--wide` lifts the limit.

use std::fmt::Write as _;

use super::{Plan, Prediction, Verdict, name};
use crate::units::{fmt_bytes, iec_unit};

/// The width when stdout is not a terminal and `COLUMNS` is not set.
pub const DEFAULT_WIDTH: usize = 100;

/// The width the table fits: `COLUMNS` when it is set (as `ls` and `git`
/// read it), else the terminal's, else [`DEFAULT_WIDTH`].
pub fn terminal_width() -> usize {
    use std::io::IsTerminal;
    let columns = std::env::var("COLUMNS").ok();
    if let Some(w) = columns.and_then(|v| v.trim().parse::<usize>().ok())
        && w > 0
    {
        return w;
    }
    if std::io::stdout().is_terminal()
        && let Ok((w, _)) = crossterm::terminal::size()
        && w > 0
    {
        return w as usize;
    }
    DEFAULT_WIDTH
}

/// A parameter count as people say it: "70.55 billion".
fn fmt_count(n: u64) -> String {
    let x = n as f64;
    match x {
        x if x >= 1e12 => format!("{:.2} trillion", x / 1e12),
        x if x >= 1e9 => format!("{:.2} billion", x / 1e9),
        x if x >= 1e6 => format!("{:.2} million", x / 1e6),
        x if x >= 1e4 => format!("{:.1} thousand", x / 1e3),
        _ => n.to_string(),
    }
}

/// What the caching allocator's fragmentation takes at a fitting point
/// whose margin is smaller than that, if so: there the margin is within
/// what a change in allocation order can move. The figure is PyTorch's
/// caching allocator modelled over the point's tensors
/// (`max_memory_reserved - max_memory_allocated`, hf-eager on a GPU); other
/// points have none.
fn tight(p: &Prediction) -> Option<u64> {
    let frag = fragmentation(p)?;
    (p.verdict == Verdict::Fits && p.margin_bytes < frag as i64).then_some(frag)
}

fn fragmentation(p: &Prediction) -> Option<u64> {
    p.allocator
        .map(|a| a.max_memory_reserved.saturating_sub(a.max_memory_allocated))
}

fn status(p: &Prediction) -> String {
    match &p.verdict {
        Verdict::Fits => match (p.excluded, tight(p).is_some()) {
            (false, false) => "fits".into(),
            (true, false) => "fits (numerics)".into(),
            (false, true) => "fits (tight)".into(),
            (true, true) => "fits (numerics, tight)".into(),
        },
        Verdict::DoesNotFit if p.margin_bytes >= 0 => "OOM (host)".into(),
        Verdict::DoesNotFit => "OOM".into(),
        Verdict::Invalid { reason } => format!("invalid: {reason}"),
    }
}

/// Rows in display order: the ranking first, then the rest as expanded.
fn order(plan: &Plan) -> Vec<usize> {
    let mut rows = plan.ranking.clone();
    rows.extend((0..plan.points.len()).filter(|i| !plan.ranking.contains(i)));
    rows
}

/// The lines above the table: the model, the GPU, the frameworks, counts.
fn header(plan: &Plan) -> Vec<String> {
    let hw = &plan.hardware;
    let active =
        (plan.active_parameters).map_or(String::new(), |a| format!(", {} active", fmt_count(a)));
    let mut out = vec![format!(
        "{} ({} parameters{active}), seq-len {}, global batch {} sequences, on {} ({} each, ${:.2}/GPU-hour, headroom {:.0}%)",
        plan.model,
        fmt_count(plan.num_parameters),
        plan.seq_len,
        plan.global_batch,
        hw.display_name,
        fmt_bytes(plan.capacity_bytes),
        plan.usd_per_gpu_hour,
        plan.headroom * 100.0
    )];
    let mut fws: Vec<_> = plan.points.iter().map(|p| p.point.framework).collect();
    fws.sort_by_key(|f| name(*f));
    fws.dedup();
    let said: Vec<&str> = fws
        .iter()
        .map(|f| match f {
            crate::engine::Framework::HfEager => {
                "hf-eager (what PyTorch + Hugging Face transformers allocate)"
            }
            crate::engine::Framework::Memfit => "memfit (memfit's own engine)",
        })
        .collect();
    out.push(format!("allocations of {}", said.join(" and ")));
    let count = |f: &dyn Fn(&Verdict) -> bool| plan.points.iter().filter(|p| f(&p.verdict)).count();
    out.push(format!(
        "{} points planned in {:.1} ms: {} fit, {} out of memory, {} invalid",
        plan.points.len(),
        plan.elapsed_ms,
        count(&|v| *v == Verdict::Fits),
        count(&|v| *v == Verdict::DoesNotFit),
        count(&|v| matches!(v, Verdict::Invalid { .. }))
    ));
    out
}

/// Never hidden to fit a width.
const KEEP: u8 = u8::MAX;

/// One column of the table, a cell per point in display order.
struct Column {
    head: String,
    /// The header when the table is too wide for `head`.
    short: String,
    /// A knob (what the point is), said once above the table when every
    /// point has the same value; predictions are always columns.
    knob: bool,
    /// The lowest are hidden first when the table is too wide.
    keep: u8,
    cells: Vec<String>,
}

/// Every column, each a cell per point of `rows`.
fn columns(plan: &Plan, rows: &[usize]) -> Vec<Column> {
    let pts: Vec<&Prediction> = rows.iter().map(|&i| &plan.points[i]).collect();
    let mut cols = Vec::new();
    let mut col =
        |head: &str, short: &str, knob: bool, keep: u8, f: &dyn Fn(&Prediction) -> String| {
            cols.push(Column {
                head: head.into(),
                short: short.into(),
                knob,
                keep,
                cells: pts.iter().map(|p| f(p)).collect(),
            });
        };
    // The row numbers: filled in by `split_constant` (a prediction does
    // not know its index).
    col("#", "#", false, KEEP, &|_| String::new());
    col("framework", "fw", true, 100, &|p| name(p.point.framework));
    col("tune", "tune", true, 180, &|p| name(p.point.finetune));
    col("loss", "loss", true, 175, &|p| name(p.point.loss));
    col(
        "offload",
        "offload",
        true,
        185,
        &|p| match p.point.offload_activations {
            false => p.point.offload.name().into(),
            true => format!("{}+act", p.point.offload.name()),
        },
    );
    col("gpus", "gpus", true, 200, &|p| p.point.gpus.to_string());
    col("pp", "pp", true, 170, &|p| {
        p.point.pipeline_stages.to_string()
    });
    // Virtual stages (interleaved 1F1B), only where a point sets them, so
    // that other plans read as before.
    if pts.iter().any(|p| p.point.virtual_stages > 1) {
        col("vpp", "vpp", true, 169, &|p| {
            p.point.virtual_stages.to_string()
        });
    }
    col(
        "tp",
        "tp",
        true,
        170,
        &|p| match (p.point.sequence_parallel, p.point.tp_comm_overlap) {
            (true, true) => format!("{}+sp+ov", p.point.tensor_parallel),
            (true, false) => format!("{}+sp", p.point.tensor_parallel),
            _ => p.point.tensor_parallel.to_string(),
        },
    );
    // Hybrid sharding's group: ZeRO over that many ranks, replicas across
    // the groups ("-": over every data-parallel rank).
    col(
        "hybrid",
        "hybrid",
        true,
        172,
        &|p| match p.point.shard_group {
            None => "-".into(),
            Some(g) => g.to_string(),
        },
    );
    col("sharding", "shard", true, 190, &|p| {
        let s = match p.point.hpz_group {
            None => name(p.point.sharding),
            Some(g) => format!("{}+hpz{g}", name(p.point.sharding)),
        };
        // Megatron's --overlap-param-gather, as the tp column's "+ov".
        match p.point.overlap_param_gather {
            true => format!("{s}+pg"),
            false => s,
        }
    });
    // A mixture of experts' capacity factor ("-": dropless), only where a
    // point sets one, so that dense plans read as before.
    if pts.iter().any(|p| !p.point.capacity_factor.is_dropless()) {
        col(
            "capacity",
            "cap",
            true,
            168,
            &|p| match p.point.capacity_factor.is_dropless() {
                true => "-".into(),
                false => p.point.capacity_factor.to_string(),
            },
        );
    }
    // Expert parallelism's group, only where a point sets one.
    if pts.iter().any(|p| p.point.expert_parallel > 1) {
        col("ep", "ep", true, 169, &|p| {
            p.point.expert_parallel.to_string()
        });
    }
    col("prec", "prec", true, 160, &|p| name(p.point.precision));
    col("optimizer", "opt", true, 165, &|p| name(p.point.optimizer));
    col("ckpt", "ckpt", true, 155, &|p| name(p.point.checkpointing));
    col("attn", "attn", true, 110, &|p| name(p.point.attention));
    col("mb", "mb", true, 195, &|p| p.point.micro_batch.to_string());
    col("accum", "acc", true, 120, &|p| match p.point.grad_accum {
        0 => "-".into(),
        a => a.to_string(),
    });
    figure_columns(plan, &pts, &mut col);
    cols
}

/// Adds a column: its head, short head, whether it is a knob, how long it
/// is kept, and its cell for a point.
type AddColumn<'a> = dyn FnMut(&str, &str, bool, u8, &dyn Fn(&Prediction) -> String) + 'a;

/// The predictions' columns: the peak and what it leaves, the links, the
/// throughput and the price, the status.
fn figure_columns(plan: &Plan, pts: &[&Prediction], col: &mut AddColumn<'_>) {
    let valid = |p: &Prediction| !matches!(p.verdict, Verdict::Invalid { .. });
    // Sizes in one unit per column, named in the header.
    let most = |f: &dyn Fn(&Prediction) -> u64| {
        iec_unit(
            pts.iter()
                .filter(|p| valid(p))
                .map(|p| f(p))
                .max()
                .unwrap_or(0),
        )
    };
    let in_unit = |x: f64, size: u64| match size {
        1 => format!("{x:.0}"),
        _ => format!("{:.2}", x / size as f64),
    };
    let (unit, size) = most(&|p| p.total_bytes);
    col(
        &format!("peak {unit}"),
        &format!("peak {unit}"),
        false,
        KEEP,
        &|p| match valid(p) {
            true => in_unit(p.total_bytes as f64, size),
            false => "-".into(),
        },
    );
    // Dropless expert parallelism: the peak if the routing sent every
    // token of the group to this rank's experts first.
    if pts.iter().any(|p| p.worst_routing_bytes.is_some()) {
        col(
            &format!("worst-routed {unit}"),
            &format!("worst {unit}"),
            false,
            235,
            &|p| match (valid(p), p.worst_routing_bytes) {
                (true, Some(w)) => in_unit(w as f64, size),
                _ => "-".into(),
            },
        );
    }
    let (unit, size) = most(&|p| p.margin_bytes.unsigned_abs());
    col(
        &format!("margin {unit}"),
        &format!("left {unit}"),
        false,
        240,
        &|p| match valid(p) {
            true => in_unit(p.margin_bytes as f64, size),
            false => "-".into(),
        },
    );
    if pts.iter().any(|p| p.host.is_some()) {
        col("host/node", "host", false, 130, &|p| {
            p.host
                .as_ref()
                .map_or("-".into(), |h| fmt_bytes(h.node_bytes))
        });
    }
    if pts.iter().any(|p| p.paged.is_some()) {
        // Unified memory: on the device / paged out to the host.
        col("paged dev/host", "paged", false, 140, &|p| {
            p.paged.as_ref().map_or("-".into(), |g| {
                format!(
                    "{}/{}",
                    fmt_bytes(g.resident_bytes),
                    fmt_bytes(g.host_bytes)
                )
            })
        });
    }
    col("links", "links", true, 90, &|p| links(plan, p));
    col("tokens/s", "tok/s", false, 125, &|p| match valid(p) {
        true => format!("{:.0}", p.tokens_per_s),
        false => "-".into(),
    });
    col("$/Mtok", "$/Mtok", false, 230, &|p| match valid(p) {
        true => super::usd(p.usd_per_mtok),
        false => "-".into(),
    });
    col("status", "status", false, KEEP, &|p| status(p));
}

/// The table's columns with the row numbers filled in, and the knobs that
/// every point shares said as `head value` (a shared "-" says nothing).
fn split_constant(plan: &Plan, rows: &[usize]) -> (Vec<Column>, Vec<String>) {
    let mut cols = columns(plan, rows);
    cols[0].cells = rows.iter().map(usize::to_string).collect();
    let mut same = Vec::new();
    if rows.len() < 2 {
        return (cols, same);
    }
    cols.retain(|c| {
        let first = &c.cells[0];
        if !c.knob || c.cells.iter().any(|x| x != first) {
            return true;
        }
        if first != "-" {
            same.push(format!("{} {first}", c.head));
        }
        false
    });
    (cols, same)
}

fn chars(s: &str) -> usize {
    s.chars().count()
}

/// The words of `text`, a figure and its unit ("2.08 B/param", "1.97
/// GiB,") kept together as one.
fn words(text: &str) -> Vec<String> {
    const UNITS: [&str; 10] = [
        "B", "KiB", "MiB", "GiB", "TiB", "B/param", "s", "GB/s", "ms", "%",
    ];
    let mut out: Vec<String> = Vec::new();
    for w in text.split(' ').filter(|w| !w.is_empty()) {
        let unit = UNITS.contains(&w.trim_end_matches([',', ';', ':', ')', '.']));
        match out.last_mut() {
            Some(prev) if unit && prev.ends_with(|c: char| c.is_ascii_digit()) => {
                prev.push(' ');
                prev.push_str(w);
            }
            _ => out.push(w.to_string()),
        }
    }
    out
}

/// `text` broken at spaces into lines of at most `width` characters (a
/// word longer than a line is cut); each line keeps the text's indent and
/// continuation lines get `hang` more. Embedded newlines start new lines.
fn wrap(text: &str, width: Option<usize>, hang: usize) -> Vec<String> {
    let mut out = Vec::new();
    for para in text.split('\n') {
        let Some(width) = width else {
            out.push(para.to_string());
            continue;
        };
        let lead = para.len() - para.trim_start_matches(' ').len();
        let first = " ".repeat(lead);
        let next = " ".repeat((lead + hang).min(width / 2));
        let mut line = first.clone();
        let mut empty = true;
        for word in words(para) {
            let mut word = word;
            loop {
                let room = width.saturating_sub(chars(&line) + usize::from(!empty));
                if chars(&word) <= room {
                    if !empty {
                        line.push(' ');
                    }
                    line.push_str(&word);
                    empty = false;
                    break;
                }
                if empty {
                    // Longer than a whole line: cut it.
                    let room = width.saturating_sub(chars(&line)).max(1);
                    let cut: String = word.chars().take(room).collect();
                    word = word.chars().skip(room).collect();
                    line.push_str(&cut);
                    if word.is_empty() {
                        empty = false;
                        break;
                    }
                }
                out.push(std::mem::replace(&mut line, next.clone()));
                empty = true;
            }
        }
        if !empty || out.is_empty() || para.is_empty() {
            out.push(line.trim_end().to_string());
        }
    }
    out
}

/// `items` after `lead`, joined by " · " and broken only between items
/// into lines of at most `width` characters (an item longer than a line
/// gets one of its own), continuation lines indented by two.
fn wrap_items(lead: &str, items: &[String], width: Option<usize>) -> Vec<String> {
    const SEP: &str = " · ";
    let room = width.unwrap_or(usize::MAX);
    let mut out = Vec::new();
    let mut line = lead.to_string();
    let mut fresh = true;
    for (i, item) in items.iter().enumerate() {
        // A line that goes on ends in the separator.
        let end = if i + 1 < items.len() { 2 } else { 0 };
        if !fresh && chars(&line) + chars(SEP) + chars(item) + end > room {
            line.push_str(" ·");
            out.push(std::mem::replace(&mut line, "  ".into()));
            fresh = true;
        }
        if !fresh {
            line.push_str(SEP);
        }
        line.push_str(item);
        fresh = false;
    }
    if !items.is_empty() {
        out.push(line);
    }
    out
}

fn push_wrapped(s: &mut String, text: &str, width: Option<usize>, hang: usize) {
    for line in wrap(text, width, hang) {
        let _ = writeln!(s, "{line}");
    }
}

/// The columns a width leaves, and theirs.
struct Layout {
    /// Indices into the columns, in order.
    shown: Vec<usize>,
    widths: Vec<usize>,
    short: bool,
    hidden: Vec<String>,
    /// Whether a status was cut to fit.
    cut: bool,
}

/// The shortest the status column may be made by cutting its cells.
const STATUS_MIN: usize = 15;

/// Which columns fit in `width` (all of them when `None`), and how wide.
fn layout(cols: &[Column], rows: usize, width: Option<usize>) -> Layout {
    let last = cols.len() - 1;
    let natural = |c: &Column, short: bool| {
        let head = if short { &c.short } else { &c.head };
        c.cells[..rows]
            .iter()
            .map(|x| chars(x))
            .chain([chars(head)])
            .max()
            .unwrap_or(0)
    };
    // The status can be cut, down to STATUS_MIN.
    let need = |i: usize, short: bool| match i == last && width.is_some() {
        true => natural(&cols[i], short).min(STATUS_MIN.max(chars(&cols[i].head))),
        false => natural(&cols[i], short),
    };
    let total = |shown: &[usize], short: bool| {
        shown.iter().map(|&i| need(i, short)).sum::<usize>() + 2 * shown.len().saturating_sub(1)
    };
    let mut shown: Vec<usize> = (0..cols.len()).collect();
    let mut short = false;
    let mut hidden = Vec::new();
    if let Some(w) = width {
        short = total(&shown, false) > w;
        while total(&shown, short) > w {
            let Some(pos) = (0..shown.len())
                .filter(|&p| cols[shown[p]].keep < KEEP)
                .min_by_key(|&p| cols[shown[p]].keep)
            else {
                break;
            };
            hidden.push(cols[shown.remove(pos)].head.clone());
        }
        // With columns hidden the full headers may fit again.
        short = short && total(&shown, false) > w;
    }
    let mut widths: Vec<usize> = shown.iter().map(|&i| natural(&cols[i], short)).collect();
    let mut cut = false;
    if let Some(w) = width {
        let others = widths[..widths.len() - 1].iter().sum::<usize>() + 2 * (widths.len() - 1);
        let room = w.saturating_sub(others).max(need(last, short));
        let status = widths.last_mut().expect("the status column");
        if *status > room {
            *status = room;
            cut = true;
        }
    }
    Layout {
        shown,
        widths,
        short,
        hidden,
        cut,
    }
}

/// `cell` cut to `width` characters, its last one an ellipsis, if longer.
fn clip(cell: &str, width: usize) -> String {
    match chars(cell) > width {
        true => {
            let mut c: String = cell.chars().take(width.saturating_sub(1)).collect();
            c.push('…');
            c
        }
        false => cell.to_string(),
    }
}

/// The terminal table: every point (the first `limit`), the fitting ones
/// cheapest first, then the recommendation and the bytes-per-parameter
/// comparison; `width` is what it fits (`None`: no limit).
pub fn table(plan: &Plan, limit: usize, width: Option<usize>) -> String {
    let mut s = String::new();
    for line in header(plan) {
        push_wrapped(&mut s, &line, width, 2);
    }
    let rows = order(plan);
    let (mut cols, same) = split_constant(plan, &rows);
    let shown_rows = rows.len().min(limit);
    let _ = writeln!(s);
    for line in wrap_items("every point: ", &same, width) {
        let _ = writeln!(s, "{line}");
    }
    // Within a width, an invalid point's reason (a sentence) is a numbered
    // note under the table, each reason once.
    let mut reasons: Vec<&str> = Vec::new();
    if width.is_some() {
        let status = &mut cols.last_mut().expect("the status column").cells;
        for (r, &i) in rows.iter().enumerate().take(shown_rows) {
            if let Verdict::Invalid { reason } = &plan.points[i].verdict {
                let n = match reasons.iter().position(|x| x == reason) {
                    Some(n) => n,
                    None => {
                        reasons.push(reason);
                        reasons.len() - 1
                    }
                };
                status[r] = format!("invalid ({})", n + 1);
            }
        }
    }
    let lay = layout(&cols, shown_rows, width);
    // Numbers right, the status (last, free text) left.
    let line = |cells: Vec<&str>| {
        let n = cells.len();
        cells
            .iter()
            .zip(&lay.widths)
            .enumerate()
            .map(|(i, (c, &w))| match i + 1 == n {
                true => clip(c, w),
                false => format!("{:>w$}", c),
            })
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let heads = lay.shown.iter().map(|&i| match lay.short {
        true => cols[i].short.as_str(),
        false => cols[i].head.as_str(),
    });
    let _ = writeln!(s, "{}", line(heads.collect()));
    for r in 0..shown_rows {
        let _ = writeln!(
            s,
            "{}",
            line(
                lay.shown
                    .iter()
                    .map(|&i| cols[i].cells[r].as_str())
                    .collect()
            )
        );
    }
    if rows.len() > limit {
        push_wrapped(
            &mut s,
            &format!(
                "... {} more points (--top N shows more, --format json lists them all)",
                rows.len() - limit
            ),
            width,
            4,
        );
    }
    for (n, reason) in reasons.iter().enumerate() {
        push_wrapped(&mut s, &format!("({}) {reason}", n + 1), width, 4);
    }
    if !lay.hidden.is_empty() || lay.cut {
        let what = match (lay.hidden.is_empty(), lay.cut) {
            (false, false) => format!("columns hidden: {}", lay.hidden.join(", ")),
            (false, true) => format!(
                "columns hidden: {}; statuses cut short (…)",
                lay.hidden.join(", ")
            ),
            _ => "statuses cut short (…)".into(),
        };
        push_wrapped(
            &mut s,
            &format!(
                "{what} to fit {} characters (--wide shows every column, --format json every figure)",
                width.unwrap_or(0)
            ),
            width,
            2,
        );
    }
    for line in recommendation(plan, "") {
        push_wrapped(&mut s, &line, width, 2);
    }
    s
}

/// The recommendation's lines (without wrapping), each item after `bullet`;
/// when nothing fits, how far the nearest point is and what to try.
fn recommendation(plan: &Plan, bullet: &str) -> Vec<String> {
    let mut out = Vec::new();
    let Some(rec) = &plan.recommendation else {
        return no_fit_advice(plan)
            .into_iter()
            .map(|l| format!("{bullet}{l}"))
            .collect();
    };
    let p = &plan.points[rec.index];
    out.push(format!("\nrecommended: #{} {}", rec.index, p.point.label()));
    for r in &rec.reasons {
        out.push(format!("  {bullet}{r}"));
    }
    out.push(format!("  {bullet}{}", margin(plan, p)));
    // The split at the moment of the peak, so the parts add up to
    // the peak (each category's own maximum comes at different
    // moments, and their sum overstates it).
    let pk = p.peak_split.expect("a fitting point has peaks");
    out.push(format!(
        "  {bullet}per GPU at the peak ({}): parameters {}, gradients {}, optimizer {}, activations {}, temporaries {}, communication {}, workspace {}, runtime overhead {}",
        fmt_bytes(p.total_bytes),
        fmt_bytes(pk.parameters),
        fmt_bytes(pk.gradients),
        fmt_bytes(pk.optimizer),
        fmt_bytes(pk.activations),
        fmt_bytes(pk.temporaries),
        fmt_bytes(pk.communication),
        fmt_bytes(pk.workspace),
        fmt_bytes(p.runtime_overhead_bytes)
    ));
    if let Some(a) = p.allocator {
        out.push(format!(
            "  {bullet}PyTorch's caching allocator: max_memory_allocated {} (tensors {} rounded to 512 B blocks), max_memory_reserved {} (2 MiB / 20 MiB segments, fragmentation); the peak above is reserved + runtime overhead",
            fmt_bytes(a.max_memory_allocated),
            fmt_bytes(pk.total),
            fmt_bytes(a.max_memory_reserved)
        ));
    }
    if let Some(w) = p.worst_routing_bytes {
        out.push(format!(
            "  {bullet}dropless routing over {} expert-parallel GPUs: the peak above spreads every GPU's tokens evenly over the experts; if every token of the group chose one GPU's experts first it would hold {} ({}); a capacity factor (grid.capacity_factor) bounds it",
            p.point.expert_parallel,
            fmt_bytes(w),
            match w as i64 <= p.usable_bytes as i64 {
                true => "still fits",
                false => "out of memory",
            }
        ));
    }
    if let Some(mb) = p.reserved_from_micro_batch {
        out.push(format!(
            "  {bullet}the peak above is micro-batch {mb}'s reserved figure, which fragments more than this one: a bigger micro-batch is never planned to hold less"
        ));
    }
    out.push(format!(
        "  {bullet}model states: closed form {}; engine {:.2} B/param (its peaks include the transient full gradients and gathered units)",
        p.closed_form.formula, p.engine_bytes_per_param
    ));
    if let (Some(d), None) = (p.deepspeed, &p.host) {
        // Offloaded points say it with their host memory, below.
        let n = p.point.gpus;
        let (formula, ours) = match p.point.sharding {
            crate::engine::Sharding::Zero3 => (
                format!(
                    "the largest layer gathered in fp32 (4 B/param of it) + 18 B/param / {n}: 16-bit weights, fp32 weights, fp32 gradients and Adam's two moments, sharded"
                ),
                "16-bit weights and gradients and 12 B/param of fp32 weights and Adam's moments, all sharded, plus the 16-bit units gathered for the current and the next layer".to_string(),
            ),
            _ => (
                format!(
                    "4 B/param (16-bit weights and gradients, whole) + 16 B/param / {n}: fp32 weights, fp32 gradients and Adam's two moments"
                ),
                format!(
                    "16-bit weights whole, the 16-bit gradient shard and 12 B/param / {n} of fp32 weights and Adam's moments (the ZeRO paper's K = 12: no fp32 gradient copy), plus each bucket's full gradients while it is reduced"
                ),
            ),
        };
        use crate::memory::Category;
        let states: u64 = [
            Category::Parameters,
            Category::Gradients,
            Category::Optimizer,
        ]
        .iter()
        .map(|&c| pk.get(c))
        .sum();
        out.push(format!(
            "  {bullet}DeepSpeed's estimator (estimate_{}_model_states_mem_needs) says {} per GPU for the model states: {formula}; the engine's peak holds {} of them ({:.2} B/param): {ours}",
            super::name(p.point.sharding),
            fmt_bytes(d.per_gpu),
            fmt_bytes(states),
            p.engine_bytes_per_param
        ));
    }
    if let Some(h) = &p.host {
        out.push(format!(
            "  {bullet}host memory (offload {}): {} per GPU ({}), {} for a node's {} GPU(s) of {} ({} to spare); {} over the host link per step",
            p.point.offload.host_label(p.point.offload_activations),
            fmt_bytes(h.peak_bytes.total),
            crate::memory::Category::ALL
                .iter()
                .filter(|&&c| h.peak_bytes.get(c) > 0)
                .map(|&c| format!("{} {}", c.name(), fmt_bytes(h.peak_bytes.get(c))))
                .collect::<Vec<_>>()
                .join(", "),
            fmt_bytes(h.node_bytes),
            h.ranks_per_node,
            fmt_bytes(h.capacity_bytes),
            fmt_bytes(h.margin_bytes.max(0) as u64),
            fmt_bytes(h.link_bytes_per_step)
        ));
        if let Some(d) = h.deepspeed {
            out.push(format!(
                "  {bullet}DeepSpeed's estimator for these model states: {} per CPU (node), {} per GPU (with its 1.5x host buffer factor; no activations)",
                fmt_bytes(d.per_cpu),
                fmt_bytes(d.per_gpu)
            ));
        }
    }
    out.extend(paged_line(p, bullet));
    out.push(step_line(plan, p, bullet));
    out
}

/// A paged optimizer's state: where it is, beside the peak it is not in.
fn paged_line(p: &Prediction, bullet: &str) -> Option<String> {
    let g = p.paged.as_ref()?;
    let rest = match g.host_bytes {
        0 => "all of it stays on the device, in the room the peak leaves".to_string(),
        h => format!(
            "{} of it stays on the device, in the room the peak leaves, and the driver pages {} to host memory ({} for a node's {} GPU(s), {} to spare)",
            fmt_bytes(g.resident_bytes),
            fmt_bytes(h),
            fmt_bytes(h * g.ranks_per_node as u64),
            g.ranks_per_node,
            fmt_bytes(g.host_margin_bytes.max(0) as u64)
        ),
    };
    Some(format!(
        "  {bullet}{} ({}): {} per GPU, not in the peak above (cudaMallocManaged, not PyTorch's allocator); {rest}",
        g.memory,
        super::name(p.point.optimizer),
        fmt_bytes(g.bytes)
    ))
}

/// How the recommended point's step time adds up.
fn step_line(plan: &Plan, p: &Prediction, bullet: &str) -> String {
    let offload = match p.host {
        Some(_) => format!(
            " + offload {:.3} s (host link at {:.0}% of {} GB/s, CPU update at the node's memory bandwidth)",
            p.offload_s,
            super::HOST_LINK_EFFICIENCY * 100.0,
            plan.hardware.host_link_gbps
        ),
        None => String::new(),
    };
    let paged = match &p.paged {
        Some(g) if g.host_bytes > 0 => format!(
            " + paging {:.3} s ({} of paged optimizer state to host memory and back each step, on the host link at {:.0}% of {} GB/s)",
            g.seconds_per_step,
            fmt_bytes(g.host_bytes),
            super::HOST_LINK_EFFICIENCY * 100.0,
            plan.hardware.host_link_gbps
        ),
        Some(_) => " (the paged optimizer state stays on the device: no paging)".into(),
        None => String::new(),
    };
    let offload = offload + &paged;
    let hw = &plan.hardware;
    let comm = match p.links {
        Some(crate::comm::topology::Links::None) => "one GPU: no collective moves data".into(),
        Some(_) => format!(
            "NCCL's ring, tree or NVLS as its tuner would pick, over {} ({} GB/s per GPU) and between {}-GPU nodes {} ({} GB/s per GPU)",
            hw.interconnect,
            hw.interconnect_gbps,
            hw.gpus_per_node,
            hw.inter_node,
            hw.inter_node_gbps
        ),
        None => format!(
            "{:.0}% of {} GB/s",
            plan.efficiency["communication"] * 100.0,
            hw.interconnect_gbps
        ),
    };
    let megatron: Vec<&str> = [
        (p.point.tp_comm_overlap).then_some("--tp-comm-overlap (Transformer Engine's userbuffers)"),
        (p.point.overlap_param_gather).then_some("--overlap-param-gather"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let who = match megatron.is_empty() {
        true => "DDP and FSDP".to_string(),
        false => format!("DDP, FSDP and Megatron's {}", megatron.join(" and ")),
    };
    let hidden = match p.comm_hidden_s > 0.0 {
        true => format!(
            "; {:.3} s more runs beside the compute, as {who} overlap it",
            p.comm_hidden_s
        ),
        false => String::new(),
    };
    let roofline = match &plan.hardware.measured {
        Some(m) => {
            crate::calibrate::gpu::describe(m, p.point.precision, plan.efficiency["compute"])
        }
        None => format!(
            "roofline at {:.0}% of peak FLOP/s for large GEMMs{}, less for shapes that leave SMs idle, {:.0}% of memory bandwidth ({:.0}% for norms){}",
            plan.efficiency["compute"] * 100.0,
            match hw.gemm_efficiency {
                Some(_) => " (the profile's own share, fitted to published runs)",
                None => "",
            },
            plan.efficiency["memory"] * 100.0,
            plan.efficiency["norm"] * 100.0,
            attention_rate(hw, p),
        ),
    };
    format!(
        "  {bullet}step {:.3} s = compute {:.3} s ({roofline}{}) + communication {:.3} s waited for ({comm}; crosses {}{hidden}){offload}",
        p.step_s,
        p.compute_s,
        kernel_shares(p),
        p.comm_s,
        links(plan, p)
    )
}

/// What the compute is spent on, in shares of it: "; of it GEMMs 72%,
/// attention 11%, ..." (kinds under half a percent left out).
fn kernel_shares(p: &Prediction) -> String {
    let Some(k) = p.kernel_s.filter(|k| k.total() > 0.0) else {
        return String::new();
    };
    let kinds = ["GEMMs", "attention", "norms", "other kernels", "launches"];
    let parts: Vec<String> = (kinds.into_iter().zip(k.values()))
        .map(|(what, s)| (what, 100.0 * s / k.total()))
        .filter(|&(_, pct)| pct >= 0.5)
        .map(|(what, pct)| format!("{what} {pct:.0}%"))
        .collect();
    format!("; of it {}", parts.join(", "))
}

/// How the point's fused attention is priced, where the profile says:
/// at its kernel's published rates or at its share of the peak.
fn attention_rate(hw: &crate::config::hardware::HardwareProfile, p: &Prediction) -> String {
    if !(p.point.attention.fused() && p.point.precision.is_16bit()) {
        return String::new();
    }
    match (hw.attention_rates(), hw.fused_attention_efficiency) {
        (Some(_), _) => format!(
            ", fused attention at {}'s rates in the hardware profile for its head dimension and sequence length",
            hw.attention_kernel
        ),
        (None, Some(f)) => format!(", fused attention at {:.0}% of peak", f * 100.0),
        (None, None) => String::new(),
    }
}

/// The recommended point's margin: what is left below the usable limit
/// (capacity less headroom), against the allocator's fragmentation there.
fn margin(plan: &Plan, p: &Prediction) -> String {
    let left = format!(
        "margin {} below the {} usable per GPU ({} less the {:.0}% headroom)",
        fmt_bytes(p.margin_bytes.max(0) as u64),
        fmt_bytes(p.usable_bytes),
        fmt_bytes(plan.capacity_bytes),
        plan.headroom * 100.0
    );
    match (tight(p), fragmentation(p)) {
        (Some(f), _) => format!(
            "{left}: tight, less than the {} the caching allocator's fragmentation takes at this point (max_memory_reserved - max_memory_allocated), which another allocation order can move",
            fmt_bytes(f)
        ),
        (None, Some(f)) => format!(
            "{left}, more than the {} the caching allocator's fragmentation takes at this point (max_memory_reserved - max_memory_allocated)",
            fmt_bytes(f)
        ),
        (None, None) => format!(
            "{left}; no fragmentation figure to weigh it against (PyTorch's caching allocator is modelled for hf-eager on a GPU)"
        ),
    }
}

/// The links a point's collectives cross, by name: the node's interconnect,
/// the network between nodes, or both.
fn links(plan: &Plan, p: &Prediction) -> String {
    use crate::comm::topology::Links;
    let hw = &plan.hardware;
    match p.links {
        None | Some(Links::None) => "-".into(),
        Some(Links::Intra) => hw.interconnect.clone(),
        Some(Links::Inter) => hw.inter_node.clone(),
        Some(Links::IntraInter) => format!("{}+{}", hw.interconnect, hw.inter_node),
    }
}

/// Markdown: a table of every point (knobs shared by all said once above
/// it) and the recommendation.
pub fn markdown(plan: &Plan) -> String {
    let mut s = String::from("# memfit plan\n\n");
    for line in header(plan) {
        let _ = writeln!(s, "{line}");
    }
    let rows = order(plan);
    let (cols, same) = split_constant(plan, &rows);
    if !same.is_empty() {
        let _ = writeln!(s, "\nEvery point: {}", same.join(" · "));
    }
    let heads: Vec<&str> = cols.iter().map(|c| c.head.as_str()).collect();
    let _ = writeln!(s, "\n| {} |", heads.join(" | "));
    let _ = writeln!(s, "|{}|", vec!["---"; cols.len()].join("|"));
    for r in 0..rows.len() {
        let cells: Vec<String> = cols.iter().map(|c| c.cells[r].replace('|', "/")).collect();
        let _ = writeln!(s, "| {} |", cells.join(" | "));
    }
    let _ = writeln!(s, "\n## Recommendation");
    for line in recommendation(plan, "- ") {
        let _ = writeln!(s, "{line}");
    }
    s
}

/// When nothing is recommended: how far the nearest point is, and the
/// changes the grid did not try, each with the key that adds it (the first
/// line starts with a blank line).
pub fn no_fit_advice(plan: &Plan) -> Vec<String> {
    use crate::engine::{Checkpointing, Finetune, Offload, Sharding};
    let pts = &plan.points;
    if pts.iter().any(|p| p.verdict == Verdict::Fits) {
        return vec![
            "\nno point is recommended: every point that fits changes the numerics, and the recipe sets allow_numerics_change: false".into(),
        ];
    }
    let nearest = pts
        .iter()
        .enumerate()
        .filter(|(_, p)| p.verdict == Verdict::DoesNotFit)
        .max_by_key(|(_, p)| p.margin_bytes);
    let Some((i, near)) = nearest else {
        return vec!["\nno point fits: every point of the grid is an invalid combination (see the status column)".into()];
    };
    let mut out = vec![format!(
        "\nno point fits. The nearest, #{i} {}, needs {} more than the {} usable per GPU.",
        near.point.label(),
        fmt_bytes(near.margin_bytes.unsigned_abs()),
        fmt_bytes(near.usable_bytes)
    )];
    let tried = |f: &dyn Fn(&crate::plan::Point) -> bool| pts.iter().any(|p| f(&p.point));
    out.push("Not in this grid, and worth a try:".into());
    if !tried(&|p| p.checkpointing != Checkpointing::None) {
        out.push("  activation checkpointing (grid.checkpointing: [full])".into());
    }
    let most = pts.iter().map(|p| p.point.gpus).max().unwrap_or(1);
    // QLoRA refuses zero3 (its NF4 blocks), so a grid of QLoRA alone is
    // not sent there.
    let zero3_runs = tried(&|p| p.finetune != Finetune::Qlora);
    if !tried(&|p| p.sharding == Sharding::Zero3) && zero3_runs {
        out.push(format!(
            "  ZeRO-3 over more GPUs, every state sharded (grid.sharding: [zero3], grid.gpus: [{}])",
            (most * 2).max(2)
        ));
    }
    if !tried(&|p| p.micro_batch == 1) {
        out.push("  micro-batch 1 (grid.micro_batch: [1])".into());
    }
    if !tried(&|p| p.finetune != Finetune::Full) {
        out.push(
            "  LoRA or QLoRA instead of full fine-tuning (grid.finetune: [lora, qlora])".into(),
        );
    }
    if !tried(&|p| p.offload != Offload::None) {
        out.push(
            "  the optimizer state on the host, ZeRO-Offload (grid.offload: [optimizer])".into(),
        );
    }
    if tried(&|p| p.sharding == Sharding::Zero3) {
        out.push(format!(
            "  more GPUs to shard over (grid.gpus: [{}])",
            most * 2
        ));
    }
    // The smallest built-in GPU with room for the nearest point's deficit.
    let need = plan.hardware.memory + near.margin_bytes.unsigned_abs();
    let bigger = crate::config::hardware::builtin_hardware()
        .iter()
        .filter_map(|(name, _)| {
            crate::config::hardware::load_hardware(name)
                .ok()
                .map(|h| (*name, h))
        })
        .filter(|(_, h)| h.memory >= need)
        .min_by_key(|(_, h)| h.memory);
    if let Some((name, h)) = bigger {
        out.push(format!(
            "  a bigger GPU: {} with {} (hardware: {name})",
            h.display_name,
            fmt_bytes(h.memory)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_keeps_every_word_within_the_width_and_the_indent() {
        let text = "  per GPU at the peak (65.86 GiB): parameters 7.66 GiB, gradients 6.06 GiB, optimizer 24.64 GiB, an-unbreakable-word-longer-than-a-whole-line-of-thirty";
        for width in [30, 41, 80] {
            let lines = wrap(text, Some(width), 2);
            assert!(
                lines.iter().all(|l| chars(l) <= width),
                "{width}: {lines:#?}"
            );
            assert!(lines[0].starts_with("  per"), "{lines:?}");
            assert!(
                lines[1..].iter().all(|l| l.starts_with("    ")),
                "{lines:?}"
            );
            // Nothing lost, nothing added but breaks.
            let joined: String = lines.concat().split_whitespace().collect();
            let want: String = text.split_whitespace().collect();
            assert_eq!(joined, want, "{width}");
        }
        // A figure stays with its unit.
        let lines = wrap("aaaa 7.66 GiB", Some(10), 0);
        assert_eq!(lines, ["aaaa", "7.66 GiB"]);
        // No width: untouched; a leading newline is a blank line.
        assert_eq!(wrap("\nx  y", None, 2), ["", "x  y"]);
        assert_eq!(wrap("\nx y", Some(80), 2), ["", "x y"]);
    }

    #[test]
    fn wrap_items_breaks_only_between_items() {
        let items: Vec<String> = ["framework hf-eager", "tune full", "optimizer adamw"]
            .map(String::from)
            .to_vec();
        let lines = wrap_items("every point: ", &items, Some(40));
        assert_eq!(
            lines,
            [
                "every point: framework hf-eager ·",
                "  tune full · optimizer adamw"
            ]
        );
        assert!(wrap_items("every point: ", &[], Some(40)).is_empty());
    }

    #[test]
    fn parameter_counts_read_as_words() {
        assert_eq!(fmt_count(70_553_706_496), "70.55 billion");
        assert_eq!(fmt_count(124_439_808), "124.44 million");
        assert_eq!(fmt_count(999), "999");
    }
}
