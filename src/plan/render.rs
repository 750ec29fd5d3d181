//! The plan as a terminal table and as Markdown (JSON is the `Plan` itself).

use std::fmt::Write as _;

use super::{Plan, Prediction, Verdict, name};
use crate::units::fmt_bytes;

fn status(p: &Prediction) -> String {
    match &p.verdict {
        Verdict::Fits if p.excluded => "fits (numerics)".into(),
        Verdict::Fits => "fits".into(),
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

fn header(plan: &Plan, s: &mut String) {
    let hw = &plan.hardware;
    let _ = writeln!(
        s,
        "{} ({} parameters), seq-len {}, global batch {} sequences, on {} ({} each, ${:.2}/GPU-hour, headroom {:.0}%)",
        plan.model,
        plan.num_parameters,
        plan.seq_len,
        plan.global_batch,
        hw.display_name,
        fmt_bytes(plan.capacity_bytes),
        plan.usd_per_gpu_hour,
        plan.headroom * 100.0
    );
    let mut fws: Vec<_> = plan.points.iter().map(|p| p.point.framework).collect();
    fws.dedup();
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
    let _ = writeln!(s, "allocations of {}", said.join(" and "));
    let fits = plan
        .points
        .iter()
        .filter(|p| p.verdict == Verdict::Fits)
        .count();
    let _ = writeln!(
        s,
        "{} points planned in {:.1} ms: {} fit, {} out of memory, {} invalid",
        plan.points.len(),
        plan.elapsed_ms,
        fits,
        plan.points
            .iter()
            .filter(|p| p.verdict == Verdict::DoesNotFit)
            .count(),
        plan.points
            .iter()
            .filter(|p| matches!(p.verdict, Verdict::Invalid { .. }))
            .count()
    );
}

const COLS: [&str; 21] = [
    "#",
    "framework",
    "tune",
    "offload",
    "gpus",
    "pp",
    "tp",
    "sharding",
    "prec",
    "optimizer",
    "ckpt",
    "attn",
    "mb",
    "accum",
    "peak GiB",
    "margin GiB",
    "host/node",
    "links",
    "tokens/s",
    "$/Mtok",
    "status",
];

fn row(plan: &Plan, i: usize, p: &Prediction) -> [String; 21] {
    let pt = &p.point;
    let valid = !matches!(p.verdict, Verdict::Invalid { .. });
    let num = |x: f64, prec: usize| {
        if valid {
            format!("{x:.prec$}")
        } else {
            "-".into()
        }
    };
    [
        i.to_string(),
        name(pt.framework),
        name(pt.finetune),
        pt.offload.name().into(),
        pt.gpus.to_string(),
        pt.pipeline_stages.to_string(),
        match pt.sequence_parallel {
            true => format!("{}+sp", pt.tensor_parallel),
            false => pt.tensor_parallel.to_string(),
        },
        match pt.hpz_group {
            0 => name(pt.sharding),
            g => format!("{}+hpz{g}", name(pt.sharding)),
        },
        name(pt.precision),
        name(pt.optimizer),
        name(pt.checkpointing),
        name(pt.attention),
        pt.micro_batch.to_string(),
        if pt.grad_accum > 0 {
            pt.grad_accum.to_string()
        } else {
            "-".into()
        },
        if valid {
            fmt_bytes(p.total_bytes)
        } else {
            "-".into()
        },
        if valid {
            format!("{:.1}", p.margin_bytes as f64 / (1u64 << 30) as f64)
        } else {
            "-".into()
        },
        p.host
            .as_ref()
            .map_or("-".into(), |h| fmt_bytes(h.node_bytes)),
        links(plan, p),
        num(p.tokens_per_s, 0),
        if valid {
            super::usd(p.usd_per_mtok)
        } else {
            "-".into()
        },
        status(p),
    ]
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

/// The terminal table: every point, the fitting ones cheapest first, then the
/// recommendation and the bytes-per-parameter comparison.
pub fn table(plan: &Plan, limit: usize) -> String {
    let mut s = String::new();
    header(plan, &mut s);
    let rows: Vec<[String; 21]> = order(plan)
        .into_iter()
        .take(limit)
        .map(|i| row(plan, i, &plan.points[i]))
        .collect();
    let mut w = COLS.map(str::len);
    for r in &rows {
        for (w, c) in w.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    // Numbers right, the status (last, free text) left.
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(&w)
            .enumerate()
            .map(|(i, (c, w))| {
                if i + 1 == cells.len() {
                    c.clone()
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    let _ = writeln!(s, "\n{}", line(&COLS.map(String::from)));
    for r in &rows {
        let _ = writeln!(s, "{}", line(r));
    }
    if plan.points.len() > limit {
        let _ = writeln!(
            s,
            "... {} more points (--format json lists them all)",
            plan.points.len() - limit
        );
    }
    recommendation(plan, &mut s, "");
    s
}

fn recommendation(plan: &Plan, s: &mut String, bullet: &str) {
    match &plan.recommendation {
        None => {
            for line in no_fit_advice(plan) {
                let _ = writeln!(s, "{bullet}{line}");
            }
        }
        Some(rec) => {
            let p = &plan.points[rec.index];
            let _ = writeln!(s, "\nrecommended: #{} {}", rec.index, p.point.label());
            for r in &rec.reasons {
                let _ = writeln!(s, "  {bullet}{r}");
            }
            // The split at the moment of the peak, so the parts add up to
            // the peak (each category's own maximum comes at different
            // moments, and their sum overstates it).
            let pk = p.peak_split.expect("a fitting point has peaks");
            let _ = writeln!(
                s,
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
            );
            if let Some(a) = p.allocator {
                let _ = writeln!(
                    s,
                    "  {bullet}PyTorch's caching allocator: max_memory_allocated {} (tensors {} rounded to 512 B blocks), max_memory_reserved {} (2 MiB / 20 MiB segments, fragmentation); the peak above is reserved + runtime overhead",
                    fmt_bytes(a.max_memory_allocated),
                    fmt_bytes(pk.total),
                    fmt_bytes(a.max_memory_reserved)
                );
            }
            let _ = writeln!(
                s,
                "  {bullet}model states: closed form {}; engine {:.2} B/param (its peaks include the transient full gradients and gathered units)",
                p.closed_form.formula, p.engine_bytes_per_param
            );
            if let Some(h) = &p.host {
                let _ = writeln!(
                    s,
                    "  {bullet}host memory (offload {}): {} per GPU ({}), {} for a node's {} GPU(s) of {} ({} to spare); {} over the host link per step",
                    p.point.offload.name(),
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
                );
                if let Some(d) = h.deepspeed {
                    let _ = writeln!(
                        s,
                        "  {bullet}DeepSpeed's estimator for these model states: {} per CPU (node), {} per GPU (with its 1.5x host buffer factor; no activations)",
                        fmt_bytes(d.per_cpu),
                        fmt_bytes(d.per_gpu)
                    );
                }
            }
            let offload = match p.host {
                Some(_) => format!(
                    " + offload {:.3} s (host link at {:.0}% of {} GB/s, CPU update at the node's memory bandwidth)",
                    p.offload_s,
                    super::HOST_LINK_EFFICIENCY * 100.0,
                    plan.hardware.host_link_gbps
                ),
                None => String::new(),
            };
            let hw = &plan.hardware;
            let comm = match p.links {
                Some(crate::comm::topology::Links::None) => {
                    "one GPU: no collective moves data".into()
                }
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
            let _ = writeln!(
                s,
                "  {bullet}step {:.3} s = compute {:.3} s (roofline at {:.0}% of peak FLOP/s, {:.0}% of memory bandwidth) + communication {:.3} s ({comm}; crosses {}, not overlapped){offload}",
                p.step_s,
                p.compute_s,
                plan.efficiency["compute"] * 100.0,
                plan.efficiency["memory"] * 100.0,
                p.comm_s,
                links(plan, p)
            );
        }
    }
}

/// Markdown: a table of every point and the recommendation.
pub fn markdown(plan: &Plan) -> String {
    let mut s = String::from("# memfit plan\n\n");
    header(plan, &mut s);
    let _ = writeln!(s, "\n| {} |", COLS.join(" | "));
    let _ = writeln!(s, "|{}|", COLS.map(|_| "---").join("|"));
    for i in order(plan) {
        let cells = row(plan, i, &plan.points[i]).map(|c| c.replace('|', "/"));
        let _ = writeln!(s, "| {} |", cells.join(" | "));
    }
    let _ = writeln!(s, "\n## Recommendation");
    recommendation(plan, &mut s, "- ");
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
    if !tried(&|p| p.sharding == Sharding::Zero3) {
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
