//! Configuration: model profiles, Hugging Face imports, hardware and network
//! profiles, the knob enums they read, and how input files are read.

mod gemma;
pub mod gpu_calibration;
pub mod hardware;
pub mod hf;
pub mod input;
#[macro_use]
pub mod knobs;
// After `knobs`, whose `knob_enum!` it uses.
pub mod attention_kernels;
pub mod limits;
pub mod model;
pub mod profile;

pub use model::{Family, GemmaConfig, ModelConfig};
