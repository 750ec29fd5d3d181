//! The command line, defined once with clap; `main.rs` only dispatches.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::backend::DeviceSpec;
use crate::engine::{Checkpointing, TrainConfig};
use crate::run::RunOptions;

#[derive(Debug, Parser)]
#[command(
    name = "memfit",
    version,
    about = "Memory-footprint profiler and advisor for training transformers"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model for a few steps and report loss, throughput and peak memory by category.
    Run(RunArgs),
    /// List the built-in model profiles.
    Models,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Json,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// A built-in profile name (see `memfit models`) or a path to a profile YAML.
    #[arg(long, default_value = "gpt2-tiny")]
    pub model: String,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 4)]
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Optimizer steps (meta always plans exactly one).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Activation checkpointing: `full` keeps only each block's input and
    /// recomputes the block in the backward pass.
    #[arg(long, value_enum, default_value_t = Checkpointing::None)]
    pub checkpointing: Checkpointing,
    /// cpu or meta, optionally with an emulated capacity: cpu:limit=512MiB.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// Byte-level text to train on: a file, or a directory read recursively.
    /// Without it, a seeded synthetic token stream.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Seed for weights and data.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-4)]
    pub lr: f32,
    /// Decoupled weight decay, applied to 2-D weights only.
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    /// Clip gradients to this global norm; 0 turns clipping off.
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f32,
    /// cpu worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Write the memory timeline (one CSV line per allocation and free) to this file.
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

impl RunArgs {
    pub fn options(&self) -> RunOptions {
        RunOptions {
            model: self.model.clone(),
            train: TrainConfig {
                seq_len: self.seq_len,
                micro_batch: self.micro_batch,
                grad_accum: self.grad_accum,
                lr: self.lr,
                weight_decay: self.weight_decay,
                grad_clip: self.grad_clip,
                seed: self.seed,
                checkpointing: self.checkpointing,
                ..TrainConfig::default()
            },
            steps: self.steps,
            device: self.device.clone(),
            data: self.data.clone(),
            threads: self.threads,
            timeline: self.timeline.clone(),
        }
    }
}
