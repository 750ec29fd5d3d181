//! Run recipes: a YAML file with the same knobs as `memfit run`'s flags.
//! A flag given on the command line overrides the recipe's key.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::profile::{key_location, parse_yaml};
use crate::backend::DeviceSpec;
use crate::engine::{Attention, Checkpointing, Optimizer, Precision, Schedule, Sharding};
use crate::error::{Error, Result};

/// Every key is optional; keys mirror the long flags with `-` as `_`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRecipe {
    pub model: Option<String>,
    pub seq_len: Option<usize>,
    pub micro_batch: Option<usize>,
    pub grad_accum: Option<usize>,
    pub steps: Option<usize>,
    pub device: Option<DeviceSpec>,
    /// Relative paths are relative to the recipe's directory.
    pub data: Option<PathBuf>,
    pub seed: Option<u64>,
    pub optimizer: Option<Optimizer>,
    pub lr: Option<f32>,
    pub beta1: Option<f32>,
    pub weight_decay: Option<f32>,
    pub momentum: Option<f32>,
    pub grad_clip: Option<f32>,
    pub checkpointing: Option<Checkpointing>,
    pub attention: Option<Attention>,
    pub precision: Option<Precision>,
    pub ranks: Option<usize>,
    pub sharding: Option<Sharding>,
    pub bucket_view: Option<bool>,
    pub pipeline_stages: Option<usize>,
    pub microbatches: Option<usize>,
    pub schedule: Option<Schedule>,
    /// Stage boundaries, `"0:6,6:12"`, as `--partition` takes them.
    pub partition: Option<String>,
    pub threads: Option<usize>,
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

pub fn load_run_recipe(path: &Path) -> Result<RunRecipe> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let location = path.display().to_string();
    let mut recipe: RunRecipe = parse_yaml(&text, &location)?;
    if let Some(data) = &recipe.data
        && data.is_relative()
    {
        let base = path.parent().unwrap_or(Path::new("."));
        recipe.data = Some(base.join(data));
    }
    // A profile path in a recipe is relative to the recipe, like `data`.
    if let Some(model) = &recipe.model
        && !super::profile::builtin_models()
            .iter()
            .any(|(name, _)| name == model)
        && Path::new(model).is_relative()
    {
        let base = path.parent().unwrap_or(Path::new("."));
        recipe.model = Some(base.join(model).display().to_string());
    }
    if recipe.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
        return Err(Error::Config {
            location: key_location(&text, &location, "model"),
            message: "`model` must name a profile or a profile file".into(),
        });
    }
    Ok(recipe)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(path)
    }

    #[test]
    fn shipped_recipes_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes");
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            // Plan recipes (they name a `hardware:`) are checked by tests/plan.rs.
            let text = std::fs::read_to_string(&path).unwrap();
            if text.lines().any(|l| l.starts_with("hardware:")) {
                continue;
            }
            let r = load_run_recipe(&path).unwrap_or_else(|e| panic!("{e}"));
            assert!(r.model.is_some(), "{}", path.display());
        }
    }

    #[test]
    fn invalid_recipes_name_file_line_and_column() {
        for (file, expect) in [
            (
                "invalid/recipes/misspelled-key.yaml",
                "did you mean `micro_batch`?",
            ),
            ("invalid/recipes/bad-device.yaml", "unknown device `tpu`"),
            (
                "invalid/recipes/bad-optimizer.yaml",
                "did you mean `adamw8bit`?",
            ),
        ] {
            let err = load_run_recipe(&fixture(file)).unwrap_err().to_string();
            let name = Path::new(file).file_name().unwrap().to_str().unwrap();
            assert!(err.contains(&format!("{name}:")), "{err}");
            assert!(err.contains(expect), "{err}");
            assert!(
                err.split(':')
                    .nth(1)
                    .is_some_and(|l| l.trim().parse::<usize>().is_ok()),
                "{err}"
            );
        }
    }
}
