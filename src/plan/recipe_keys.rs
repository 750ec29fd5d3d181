//! Reading a [`PlanRecipe`]: its own keys, and the knobs it holds fixed
//! ([`RECIPE_KNOBS`]) into its [`Knobs`] by [`Knobs::read_key`].
//!
//! Written by hand, not derived with a flattened `Knobs`: serde's `flatten`
//! does not combine with `deny_unknown_fields` and loses the locations of
//! errors. Here each key is read as an identifier, so that an unknown key,
//! a grid axis or a fixed knob is refused at the key's line and column, and
//! each value as its type, at the value's.

use std::sync::LazyLock;

use serde::de::{self, DeserializeSeed, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::{Axis, FIXED_KNOBS, Grid, PlanRecipe, RECIPE_KNOBS};
use crate::knobs::Knobs;

/// A plan recipe's own keys, in the order "expected one of" lists them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Own {
    Model,
    Hardware,
    SeqLen,
    GlobalBatch,
    Grid,
    Headroom,
    Cost,
    HostUsdPerHour,
    AllowNumericsChange,
    Device,
    AttentionKernel,
    Network,
}

const OWN: &[(&str, Own)] = &[
    ("model", Own::Model),
    ("hardware", Own::Hardware),
    ("seq_len", Own::SeqLen),
    ("global_batch", Own::GlobalBatch),
    ("grid", Own::Grid),
    ("headroom", Own::Headroom),
    ("cost", Own::Cost),
    ("host_usd_per_hour", Own::HostUsdPerHour),
    ("allow_numerics_change", Own::AllowNumericsChange),
    ("device", Own::Device),
    ("attention_kernel", Own::AttentionKernel),
    ("network", Own::Network),
];

/// The recipe's own keys.
#[cfg(test)]
pub(super) fn own_keys() -> impl Iterator<Item = &'static str> {
    OWN.iter().map(|&(k, _)| k)
}

/// Every key a plan recipe takes: its own, with the fixed knobs before
/// `network` (the order the derived reader listed them in).
fn keys() -> &'static [&'static str] {
    static KEYS: LazyLock<Vec<&'static str>> = LazyLock::new(|| {
        let (last, own) = OWN.split_last().expect("keys");
        (own.iter().map(|&(k, _)| k))
            .chain(RECIPE_KNOBS.iter().copied())
            .chain([last.0])
            .collect()
    });
    &KEYS
}

/// A key read: one of the recipe's own, or a knob it holds fixed.
#[derive(Clone, Copy)]
enum Key {
    Own(&'static str, Own),
    Knob(&'static str),
}

impl Key {
    fn name(self) -> &'static str {
        match self {
            Key::Own(name, _) | Key::Knob(name) => name,
        }
    }
}

/// What key `name` is, or why a plan recipe refuses it.
fn classify<E: de::Error>(name: &str) -> Result<Key, E> {
    if let Some(&(k, own)) = OWN.iter().find(|(k, _)| *k == name) {
        return Ok(Key::Own(k, own));
    }
    if let Some(&k) = RECIPE_KNOBS.iter().find(|&&k| k == name) {
        return Ok(Key::Knob(k));
    }
    if Knobs::NAMES.contains(&name) && Axis::ALL.iter().any(|a| a.key() == name) {
        return Err(E::custom(format!(
            "`{name}` is a grid axis in a plan recipe: list its values under `grid`"
        )));
    }
    if let Some((_, why)) = FIXED_KNOBS.iter().find(|(k, _)| *k == name) {
        return Err(E::custom(format!(
            "`{name}` is a `memfit run` knob that plans hold fixed: {why}"
        )));
    }
    Err(E::unknown_field(name, keys()))
}

struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Key, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl Visitor<'_> for KeySeed {
    type Value = Key;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("field identifier")
    }
    fn visit_str<E: de::Error>(self, name: &str) -> Result<Key, E> {
        classify(name)
    }
}

struct RecipeVisitor;

impl<'de> Visitor<'de> for RecipeVisitor {
    type Value = PlanRecipe;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("struct PlanRecipe")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PlanRecipe, A::Error> {
        let mut model: Option<String> = None;
        let mut hardware: Option<String> = None;
        let mut seq_len: Option<usize> = None;
        let mut global_batch: Option<usize> = None;
        let mut grid: Option<Grid> = None;
        let mut headroom: Option<f64> = None;
        let mut cost = None;
        let mut host_usd_per_hour = None;
        let mut allow_numerics_change: Option<bool> = None;
        let mut device = None;
        let mut network = None;
        let mut attention_kernel = None;
        let mut knobs = Knobs::default();
        let mut seen: Vec<&'static str> = Vec::new();
        while let Some(key) = map.next_key_seed(KeySeed)? {
            if seen.contains(&key.name()) {
                return Err(de::Error::duplicate_field(key.name()));
            }
            seen.push(key.name());
            match key {
                Key::Own(_, own) => match own {
                    Own::Model => model = Some(map.next_value()?),
                    Own::Hardware => hardware = Some(map.next_value()?),
                    Own::SeqLen => seq_len = Some(map.next_value()?),
                    Own::GlobalBatch => global_batch = Some(map.next_value()?),
                    Own::Grid => grid = Some(map.next_value()?),
                    Own::Headroom => headroom = Some(map.next_value()?),
                    Own::Cost => cost = map.next_value()?,
                    Own::HostUsdPerHour => host_usd_per_hour = map.next_value()?,
                    Own::AllowNumericsChange => allow_numerics_change = Some(map.next_value()?),
                    Own::Device => device = map.next_value()?,
                    Own::AttentionKernel => attention_kernel = map.next_value()?,
                    Own::Network => network = map.next_value()?,
                },
                Key::Knob(name) => {
                    if !knobs.read_key(name, &mut map)? {
                        return Err(de::Error::unknown_field(name, keys()));
                    }
                }
            }
        }
        let missing = de::Error::missing_field;
        Ok(PlanRecipe {
            model: model.ok_or_else(|| missing("model"))?,
            hardware: hardware.ok_or_else(|| missing("hardware"))?,
            seq_len: seq_len.ok_or_else(|| missing("seq_len"))?,
            global_batch: global_batch.ok_or_else(|| missing("global_batch"))?,
            grid: grid.unwrap_or_default(),
            headroom: headroom.unwrap_or(0.05),
            cost,
            host_usd_per_hour,
            allow_numerics_change: allow_numerics_change.unwrap_or(true),
            device,
            knobs,
            network,
            attention_kernel,
        })
    }
}

impl<'de> Deserialize<'de> for PlanRecipe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_struct("PlanRecipe", keys(), RecipeVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::profile::parse_yaml;

    const HEAD: &str = "model: gpt2\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 8\n";

    fn read(yaml: &str) -> crate::error::Result<PlanRecipe> {
        parse_yaml(yaml, "r.yaml")
    }

    /// Each knob key is read as `memfit run` reads it; one a plan varies or
    /// fixes is refused at its line and column with the reason, and a
    /// misspelt key still gets its suggestion.
    #[test]
    fn knob_keys_are_read_or_refused_where_they_stand() {
        let r = read(&format!(
            "{HEAD}dropout: 0.1\nlora_targets: [q, v]\nhost_memory: 1TiB\nloss_chunks: null\n"
        ))
        .unwrap();
        assert_eq!(r.knobs.dropout, Some(0.1));
        assert_eq!(r.knobs.host_memory, Some(crate::units::Bytes(1 << 40)));
        assert_eq!(r.lora().targets.len(), 2);
        assert_eq!(r.knobs.loss_chunks, None);
        assert_eq!(r.loss_chunks(), crate::engine::loss::DEFAULT_CHUNKS);
        for (extra, expect) in [
            (
                "micro_batch: 2\n",
                "r.yaml:5:1: `micro_batch` is a grid axis in a plan recipe: list its values under `grid`",
            ),
            (
                "steps: 3\n",
                "r.yaml:5:1: `steps` is a `memfit run` knob that plans hold fixed: a plan prices one step",
            ),
            (
                "droput: 0.1\n",
                "r.yaml:5:1: unknown field `droput` (did you mean `dropout`?), expected one of `model`",
            ),
            (
                "optimizer_impl: fuzed\n",
                "r.yaml:5:17: optimizer_impl: unknown variant `fuzed` (did you mean `fused`?)",
            ),
            ("dropout: 0.1\ndropout: 0.2\n", "duplicate field `dropout`"),
            ("seq_len: 32\n", "duplicate field `seq_len`"),
        ] {
            let err = read(&format!("{HEAD}{extra}")).unwrap_err().to_string();
            assert!(err.starts_with(expect) || err.contains(expect), "{err}");
        }
        let err = read("hardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 8\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing field `model`"), "{err}");
    }

    /// "expected one of" lists every key once, the recipe's own and the
    /// fixed knobs'.
    #[test]
    fn the_keys_are_listed_once() {
        let k = keys();
        assert_eq!(k.len(), OWN.len() + RECIPE_KNOBS.len());
        for (i, key) in k.iter().enumerate() {
            assert!(!k[..i].contains(key), "`{key}` twice");
        }
        assert_eq!(k.last(), Some(&"network"));
    }
}
