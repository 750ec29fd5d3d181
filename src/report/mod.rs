//! The documents memfit writes and reads back: `memfit run`'s report
//! (`run`) and a sweep's (`sweep`, which `memfit check` compares).

pub mod run;
pub mod sweep;

/// A command's result: one JSON document for scripts (`--format json`, its
/// `Serialize`), or a table for a terminal. Every command that prints a
/// result prints it through [`Report::print`].
pub trait Report: serde::Serialize {
    /// The result as aligned text, each line ended.
    fn table(&self) -> String;

    /// Writes the result on stdout in `format`.
    fn print(&self, format: Format) {
        match format {
            Format::Json => println!(
                "{}",
                serde_json::to_string_pretty(self).expect("reports serialise")
            ),
            Format::Table => print!("{}", self.table()),
        }
    }
}

/// `memfit calibrate`'s result: the calibration (the JSON) and where it
/// came from (the table's last line).
#[derive(serde::Serialize)]
#[serde(transparent)]
pub struct Calibrated {
    pub calibration: crate::calibrate::Calibration,
    #[serde(skip)]
    pub source: crate::calibrate::Source,
}

impl Report for Calibrated {
    fn table(&self) -> String {
        let c = &self.calibration;
        let source = match &self.source {
            crate::calibrate::Source::Cached(p) => format!(
                "cached in {} (memfit calibrate --force measures again)",
                p.display()
            ),
            crate::calibrate::Source::Measured => format!("measured in {:.1} s", c.elapsed_s),
        };
        [
            format!("host           {}", c.host),
            format!("threads        {}", c.threads),
            format!("GEMM fp32      {:.1} GFLOP/s", c.fp32_flops_per_s / 1e9),
            format!("GEMM bf16      {:.1} GFLOP/s", c.bf16_flops_per_s / 1e9),
            format!("GEMM fp16      {:.1} GFLOP/s", c.fp16_flops_per_s / 1e9),
            format!(
                "other kernels  {:.1} GFLOP/s fp32, {:.1} 16-bit (attention)",
                c.fp32_kernel_flops_per_s / 1e9,
                c.bf16_kernel_flops_per_s / 1e9
            ),
            format!("memory         {:.1} GB/s", c.bytes_per_s / 1e9),
            format!("per op         {:.1} µs", c.op_overhead_s * 1e6),
            source,
        ]
        .map(|line| line + "\n")
        .concat()
    }
}

/// Why a GPU calibration bound to no profile is not used yet.
pub fn unbound(gpu: &str) -> String {
    format!(
        "no built-in hardware profile matches {gpu}: no plan uses this calibration until one is named (memfit calibrate --device cuda --profile NAME|PATH)"
    )
}

/// `memfit calibrate --device cuda`'s result: the stored calibration (the
/// JSON) and where it came from.
#[derive(serde::Serialize)]
#[serde(transparent)]
pub struct GpuCalibrated {
    pub calibration: crate::config::gpu_calibration::GpuCalibration,
    #[serde(skip)]
    pub source: crate::calibrate::Source,
}

impl Report for GpuCalibrated {
    fn table(&self) -> String {
        let c = &self.calibration;
        let g = |v: f64| format!("{:.1}", v / 1e9);
        let mut lines = vec![
            format!(
                "gpu        {} ({})",
                c.gpu,
                crate::units::fmt_bytes(c.memory)
            ),
            match &c.profile {
                Some(p) => format!("profile    {p}: `memfit plan` on it uses these figures"),
                None => format!("profile    none: {}", unbound(&c.gpu)),
            },
            format!(
                "measured   {} by memfit {}, --max-dim {}",
                crate::calibrate::gpu::date(c.measured_unix_s),
                c.memfit_version,
                c.max_dim
            ),
            "GEMM       dtype  shape       M×N×K                GFLOP/s".into(),
        ];
        for p in &c.gemm {
            lines.push(format!(
                "           {:<6} {:<11} {:<20} {}",
                p.dtype,
                p.shape,
                format!("{}×{}×{}", p.m, p.n, p.k),
                g(p.flops_per_s)
            ));
        }
        lines.push(
            "attention  seq_len  batch×heads×head_dim  GFLOP/s (bf16, causal, fwd+bwd)".into(),
        );
        for p in &c.attention {
            lines.push(format!(
                "           {:<8} {:<20} {}",
                p.seq_len,
                format!("{}×{}×{}", p.batch, p.heads, p.head_dim),
                g(p.flops_per_s)
            ));
        }
        lines.push(format!("memory     {} GB/s", g(c.bytes_per_s)));
        lines.push(format!("per kernel {:.2} µs", c.op_overhead_s * 1e6));
        lines.push(match &self.source {
            crate::calibrate::Source::Cached(p) => format!(
                "cached in {} (memfit calibrate --device cuda --force measures again)",
                p.display()
            ),
            crate::calibrate::Source::Measured => format!("measured in {:.1} s", c.elapsed_s),
        });
        lines.into_iter().map(|l| l + "\n").collect()
    }
}

/// How a command writes its result (`--format`): the commands whose
/// result is a document to paste take [`DocFormat`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns for a terminal.
    Table,
    /// One JSON document, for scripts.
    Json,
}

/// `--format` of the commands whose result also reads as Markdown (`memfit
/// plan`, `memfit check`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DocFormat {
    /// Aligned columns for a terminal.
    Table,
    /// The whole result as one JSON document, for scripts.
    Json,
    /// A Markdown table and a summary, for a README, a PR or
    /// `$GITHUB_STEP_SUMMARY`.
    Md,
}
