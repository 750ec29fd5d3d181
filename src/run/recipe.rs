//! Run recipes: a YAML file with the same knobs as `memfit run`'s flags.
//! A flag given on the command line overrides the recipe's key.

use std::path::Path;

use crate::config::profile::{parse_yaml, value_location};
use crate::error::{Error, Result};
use crate::knobs::Knobs;

/// A run recipe: the knobs it sets (every key optional, the long flags'
/// names with `_` for `-`) and the file it came from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunRecipe {
    pub knobs: Knobs,
    /// The file it came from, for errors found after loading.
    pub origin: Option<Origin>,
}

/// Where a recipe was read from, and its text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Origin {
    pub location: String,
    pub text: String,
}

impl RunRecipe {
    /// An error at `key:` in the recipe's file, `file:line:column: `key`: message`.
    pub fn error(&self, key: &str, message: impl std::fmt::Display) -> Error {
        let origin = self.origin.clone().unwrap_or_default();
        Error::Config {
            location: value_location(&origin.text, &origin.location, key, None),
            message: format!("`{key}`: {message}"),
        }
    }
}

pub fn load_run_recipe(path: &Path) -> Result<RunRecipe> {
    let text = crate::config::input::read_text(path)?;
    let location = path.display().to_string();
    let mut knobs: Knobs = parse_yaml(&text, &location)?;
    let base = path.parent().unwrap_or(Path::new("."));
    if let Some(data) = &knobs.data
        && data.is_relative()
    {
        knobs.data = Some(base.join(data));
    }
    // A profile path in a recipe is relative to the recipe, like `data`; a
    // bare name stays a name, so that a misspelt one gets a suggestion.
    if let Some(model) = &knobs.model
        && !crate::config::profile::builtin_models()
            .iter()
            .any(|(name, _)| name == model)
        && Path::new(model).is_relative()
        && (crate::config::profile::looks_like_path(model) || base.join(model).is_file())
    {
        knobs.model = Some(base.join(model).display().to_string());
    }
    let recipe = RunRecipe {
        knobs,
        origin: Some(Origin { location, text }),
    };
    if recipe
        .knobs
        .model
        .as_deref()
        .is_some_and(|m| m.trim().is_empty())
    {
        return Err(recipe.error("model", "must name a profile or a profile file"));
    }
    Ok(recipe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

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
            // Plan recipes (they name a `hardware:`) are checked by tests/it/plan.rs.
            let text = std::fs::read_to_string(&path).unwrap();
            if text.lines().any(|l| l.starts_with("hardware:")) {
                continue;
            }
            let r = load_run_recipe(&path).unwrap_or_else(|e| panic!("{e}"));
            assert!(r.knobs.model.is_some(), "{}", path.display());
        }
    }

    #[test]
    fn invalid_recipes_name_file_line_and_column() {
        for (file, expect) in [
            (
                "invalid/recipes/misspelled-key.yaml",
                "did you mean `micro_batch`?",
            ),
            // The value's own line and column, not the mapping's 1:1.
            (
                "invalid/recipes/bad-device.yaml",
                "bad-device.yaml:2:9: device: unknown device `tpu`",
            ),
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

    #[test]
    fn a_bare_model_name_stays_a_name_so_a_typo_gets_a_suggestion() {
        // It was joined to the recipe's directory, then failed as a missing file.
        let r = load_run_recipe(&fixture("invalid/recipes/unknown-model.yaml")).unwrap();
        assert_eq!(r.knobs.model.as_deref(), Some("gpt2-tinyy"));
        let err = r.error("model", "x").to_string();
        assert!(err.contains("unknown-model.yaml:1:1: `model`: x"), "{err}");
    }

    #[test]
    fn a_byte_order_mark_is_dropped_and_lines_stay_right() {
        let dir = std::env::temp_dir().join(format!("memfit-recipe-bom-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.yaml");
        std::fs::write(&path, "\u{feff}model: gpt2-tiny\nsteps: 2\n").unwrap();
        let r = load_run_recipe(&path).unwrap();
        assert_eq!(
            (r.knobs.model.as_deref(), r.knobs.steps),
            (Some("gpt2-tiny"), Some(2))
        );
        std::fs::write(&path, "\u{feff}model: gpt2-tiny\nsteps: many\n").unwrap();
        let err = load_run_recipe(&path).unwrap_err().to_string();
        assert!(err.contains("r.yaml:2:8: "), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
