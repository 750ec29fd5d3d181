//! Configuration: model profiles, Hugging Face imports, hardware profiles and run recipes.

pub mod hardware;
pub mod hf;
pub mod input;
pub mod knobs;
pub mod limits;
pub mod model;
pub mod profile;
pub mod recipe;

pub use model::{Family, ModelConfig};
