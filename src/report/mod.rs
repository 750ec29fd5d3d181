//! The documents memfit writes and reads back: `memfit run`'s report
//! (`run`) and a sweep's (`sweep`, which `memfit check` compares).

pub mod run;
pub mod sweep;

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
