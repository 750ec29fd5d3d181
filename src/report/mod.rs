//! The documents memfit writes and reads back: `memfit run`'s report
//! (`run`) and a sweep's (`sweep`, which `memfit check` compares).

pub mod run;
pub mod sweep;

/// How a command writes its result (`--format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns for a terminal.
    Table,
    /// One JSON document, for scripts.
    Json,
}
