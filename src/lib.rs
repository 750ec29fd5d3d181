//! memfit: a memory-footprint profiler and advisor for training transformers.
//!
//! See ARCHITECTURE.md for the map of the code.

pub mod backend;
pub mod balance;
pub mod balance_cmd;
pub mod caching;
pub mod calibrate;
pub mod check;
pub mod cli;
pub mod comm;
#[macro_use]
pub mod config;
pub mod data;
pub mod doctor;
pub mod engine;
pub mod error;
#[cfg(feature = "test-hooks")]
pub mod faults;
pub mod knobs;
pub mod launch;
pub mod memory;
pub mod nf4;
pub mod plan;
pub mod profiles_cmd;
pub mod reference;
pub mod report;
pub mod rng;
pub mod run;
pub mod selftest;
pub mod stats;
pub mod sweep;
pub mod sys;
pub mod telemetry;
pub mod tui;
pub mod ui;
pub mod units;
pub mod watch;

pub use error::{Error, Result};
