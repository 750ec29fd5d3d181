//! Configuration: model profiles (and later hardware profiles and recipes).

pub mod hardware;
pub mod hf;
pub mod model;
pub mod profile;
pub mod recipe;

pub use model::{Family, ModelConfig};
