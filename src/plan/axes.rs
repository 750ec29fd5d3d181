//! A plan's axes, declared once. Each entry of the [`axes!`] list is one
//! knob plans vary: its recipe key, its value type and its default. From it
//! come the recipe's [`Grid`] (a list per axis), the [`Point`] (a value per
//! axis), the [`Axis`] enum, and what every consumer does with an axis
//! without naming it: the grid's size, dropping repeated values, the
//! expansion into points, and reading and writing a value as recipes spell
//! it (the TUI's builder, its fit map and its fixes). What is particular to
//! an axis, how the engine takes it (`Point::train_config`) and how a label,
//! a trial id or a table column shows it, stays where it is used.

use std::collections::HashSet;
use std::num::NonZeroUsize;

use serde::{Deserialize, Serialize};

use super::Capacity;
use crate::config::knobs::group;
use crate::engine::{
    Attention, Checkpointing, Finetune, Framework, Loss, Offload, Optimizer, Precision, Sharding,
};

fn is_one(x: &usize) -> bool {
    *x == 1
}

/// A value on a plan axis, as recipes, reports and the TUI spell it.
pub trait AxisValue: Copy + PartialEq + Sized {
    fn spell(&self) -> String;
    /// The value a spelling names, if any.
    fn read(s: &str) -> Option<Self>;
}

impl AxisValue for usize {
    fn spell(&self) -> String {
        self.to_string()
    }
    fn read(s: &str) -> Option<Self> {
        s.parse().ok()
    }
}

impl AxisValue for bool {
    fn spell(&self) -> String {
        self.to_string()
    }
    fn read(s: &str) -> Option<Self> {
        s.parse().ok()
    }
}

/// A group that may be off: its size, `0` when off.
impl AxisValue for Option<NonZeroUsize> {
    fn spell(&self) -> String {
        group::spelled(*self)
    }
    fn read(s: &str) -> Option<Self> {
        s.parse().ok().map(group::from_size)
    }
}

impl AxisValue for Capacity {
    fn spell(&self) -> String {
        self.spelled()
    }
    fn read(s: &str) -> Option<Self> {
        s.parse().ok()
    }
}

/// The knob enums, by their flag and recipe names.
macro_rules! enum_values {
    ($($t:ty),*) => {$(
        impl AxisValue for $t {
            fn spell(&self) -> String {
                crate::config::knobs::name(*self)
            }
            fn read(s: &str) -> Option<Self> {
                <$t as clap::ValueEnum>::from_str(s, false).ok()
            }
        }
    )*};
}

enum_values!(
    Precision,
    Checkpointing,
    Attention,
    Optimizer,
    Sharding,
    Framework,
    Finetune,
    Offload,
    Loss
);

/// Declares the axes: `Variant key: Type = default`, optionally followed
/// by `grid #[attr]` (on the grid's list) and `point #[attr]` (on the
/// point's value). The list runs from the axis that varies fastest in a
/// plan's points (the last key of the product) to the slowest.
macro_rules! axes {
    ($(
        $(#[doc = $doc:literal])*
        $variant:ident $key:ident: $ty:ty = $default:expr
        $(, grid #[$gattr:meta])? $(, point #[$pattr:meta])?;
    )*) => {
        /// One of a plan's axes.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Axis {
            $( $(#[doc = $doc])* $variant, )*
        }

        /// The knobs to sweep; each key is a list, a missing key takes its
        /// one default value.
        #[derive(Clone, Debug, Deserialize, Serialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct Grid {
            $( $(#[doc = $doc])* $(#[$gattr])? pub $key: Vec<$ty>, )*
        }

        /// One grid point's knobs. A key missing from a report takes its
        /// default, so that reports from before an axis still read.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(default)]
        pub struct Point {
            $( $(#[doc = $doc])* $(#[$pattr])? pub $key: $ty, )*
            /// global_batch / (micro_batch x data-parallel replicas); 0
            /// when that is not a whole number.
            pub grad_accum: usize,
        }

        impl Default for Point {
            fn default() -> Point {
                Point { $( $key: $default, )* grad_accum: 0 }
            }
        }

        impl Grid {
            /// Each list holding its axis's default alone.
            fn declared() -> Grid {
                Grid { $( $key: vec![$default], )* }
            }
        }

        impl Axis {
            /// Every axis, the fastest-varying first.
            pub const ALL: &[Axis] = &[$( Axis::$variant ),*];

            /// The recipe's key.
            pub fn key(self) -> &'static str {
                match self { $( Axis::$variant => stringify!($key), )* }
            }

            /// How many values the grid lists on this axis.
            pub fn len(self, g: &Grid) -> usize {
                match self { $( Axis::$variant => g.$key.len(), )* }
            }

            /// The values the grid has on this axis, as the recipe spells them.
            pub fn get(self, g: &Grid) -> Vec<String> {
                match self { $( Axis::$variant => g.$key.iter().map(AxisValue::spell).collect(), )* }
            }

            /// Puts `values` (recipe spellings; unknown ones are dropped) on this axis.
            pub fn set(self, g: &mut Grid, values: &[String]) {
                match self {
                    $( Axis::$variant => g.$key = values.iter().filter_map(|v| AxisValue::read(v)).collect(), )*
                }
            }

            /// A point's value on this axis.
            pub fn of(self, p: &Point) -> String {
                match self { $( Axis::$variant => p.$key.spell(), )* }
            }

            /// Sets a point's value on this axis; false when `v` is no value of it.
            pub fn put(self, p: &mut Point, v: &str) -> bool {
                match self {
                    $( Axis::$variant => AxisValue::read(v).map(|x| p.$key = x).is_some(), )*
                }
            }

            /// Drops repeated values from the grid's list, keeping the first
            /// of each in its place: the first value repeated and how many
            /// distinct values were, if any was.
            fn dedup(self, g: &mut Grid) -> Option<(String, usize)> {
                match self { $( Axis::$variant => keep_first(&mut g.$key), )* }
            }

            /// Each of `points` once per value on this axis, the values
            /// varying fastest.
            fn spread(self, g: &Grid, points: Vec<Point>) -> Vec<Point> {
                match self { $( Axis::$variant => spread(points, &g.$key, |p, v| p.$key = v), )* }
            }
        }
    };
}

axes! {
    MicroBatch micro_batch: usize = 1;
    /// eager and/or fused.
    Attention attention: Attention = Attention::Fused;
    /// none and/or full.
    Checkpointing checkpointing: Checkpointing = Checkpointing::None;
    /// fp32, bf16, fp16 and/or bf16-pure.
    Precision precision: Precision = Precision::Bf16;
    /// adamw, adamw8bit, paged-adamw, paged-adamw8bit, adafactor and/or sgd.
    Optimizer optimizer: Optimizer = Optimizer::Adamw;
    /// none (one GPU), ddp, zero1, zero2 and/or zero3.
    Sharding sharding: Sharding = Sharding::None;
    /// GPUs in all: pipeline stages x data-parallel replicas x tensor
    /// parallel.
    Gpus gpus: usize = 1;
    /// Whose allocations to plan: hf-eager (PyTorch + transformers) and/or
    /// memfit (the engine's own). Absent: hf-eager for `memfit plan`, whose
    /// recommendation users run in PyTorch; memfit for `memfit sweep`, whose
    /// trials the engine runs.
    Framework framework: Framework = Framework::Memfit;
    /// full, lora and/or qlora.
    Finetune finetune: Finetune = Finetune::Full;
    /// ZeRO-Offload: none, optimizer and/or optimizer+params.
    Offload offload: Offload = Offload::None;
    /// Pipeline stages; `gpus` is then stages x data-parallel replicas.
    PipelineStages pipeline_stages: usize = 1;
    /// Virtual pipeline stages (interleaved 1F1B, Megatron-LM's): model
    /// chunks per stage (1: none, which a point's JSON leaves out).
    VirtualStages virtual_stages: usize = 1,
        point #[serde(skip_serializing_if = "is_one")];
    /// Hybrid sharding: ZeRO over groups of this many GPUs (a node's),
    /// replicated across groups; 0 (or null) shards over every GPU.
    ShardGroup shard_group: Option<NonZeroUsize> = None,
        grid #[serde(with = "group::list")], point #[serde(with = "group")];
    /// Tensor parallelism (Megatron-LM): GPUs per group that split every
    /// block; `gpus` is then stages x data-parallel replicas x this.
    TensorParallel tensor_parallel: usize = 1;
    /// Megatron's sequence parallelism, with tensor parallelism.
    SequenceParallel sequence_parallel: bool = false;
    /// ZeRO++ hpZ (zero3): backward gathers within groups of this many
    /// GPUs (a node's), from a secondary copy of the weights; 0 (or null):
    /// off.
    HpzGroup hpz_group: Option<NonZeroUsize> = None,
        grid #[serde(with = "group::list")], point #[serde(with = "group")];
    /// How the loss meets the head: full, chunked (torchtune's, hf-eager),
    /// fused-linear (Liger's) and/or megatron-unfused (Megatron-Core's
    /// default, memfit).
    Loss loss: Loss = Loss::Full;
    /// Mixture-of-experts capacity factors: each expert takes
    /// ceil(f x tokens x top-k / experts) rows, padded, the overflow
    /// dropped; `null` is dropless routing (Megatron-Core's default), which
    /// a point's JSON leaves out so that dense plans read as before.
    CapacityFactor capacity_factor: Capacity = Capacity::DROPLESS,
        point #[serde(skip_serializing_if = "Capacity::is_dropless")];
    /// Expert parallelism: consecutive data-parallel GPUs that split a
    /// mixture's experts (1: none, which a point's JSON leaves out).
    ExpertParallel expert_parallel: usize = 1,
        point #[serde(skip_serializing_if = "is_one")];
    /// torchtune's activation offloading, with full checkpointing: false
    /// and/or true; a point's JSON leaves out false.
    OffloadActivations offload_activations: bool = false,
        point #[serde(skip_serializing_if = "std::ops::Not::not")];
    /// Megatron's `--tp-comm-overlap` (Transformer Engine's userbuffers),
    /// with sequence parallelism: false and/or true; a point's JSON
    /// leaves out false.
    TpCommOverlap tp_comm_overlap: bool = false,
        point #[serde(skip_serializing_if = "std::ops::Not::not")];
    /// Megatron's `--overlap-param-gather`, with zero1 or zero2: the
    /// gathers of the weights the optimizer step updated run beside the
    /// next step's first forward instead of before it; false and/or true;
    /// a point's JSON leaves out false.
    OverlapParamGather overlap_param_gather: bool = false,
        point #[serde(skip_serializing_if = "std::ops::Not::not")];
}

/// A grid that names no framework plans the one its command chooses
/// ([`Grid::frameworks_or`]); every other axis has its one default.
impl Default for Grid {
    fn default() -> Self {
        Grid {
            framework: Vec::new(),
            ..Grid::declared()
        }
    }
}

impl Grid {
    /// The number of points, or `None` past `usize`.
    pub fn size(&self) -> Option<usize> {
        (Axis::ALL.iter()).try_fold(1usize, |n, &a| match a {
            // No framework named: the command's one.
            Axis::Framework => n.checked_mul(a.len(self).max(1)),
            _ => n.checked_mul(a.len(self)),
        })
    }

    /// Drops repeated values from each list, keeping the first of each in
    /// its place. Returns, per list with repeats, its key, the first value
    /// repeated and how many distinct values were.
    pub fn dedup(&mut self) -> Vec<(&'static str, String, usize)> {
        (Axis::ALL.iter())
            .filter_map(|&a| a.dedup(self).map(|(first, n)| (a.key(), first, n)))
            .collect()
    }

    /// The frameworks to plan, `default` when the recipe names none.
    pub fn frameworks_or(&mut self, default: Framework) {
        if self.framework.is_empty() {
            self.framework = vec![default];
        }
    }

    /// Every point of the grid: the product of its lists, the first axis
    /// of [`Axis::ALL`] varying fastest, each point's accumulation left 0.
    /// A grid naming no framework gives memfit's points.
    pub fn points(&self) -> Vec<Point> {
        let mut g = self.clone();
        g.frameworks_or(Framework::Memfit);
        (Axis::ALL.iter().rev()).fold(vec![Point::default()], |out, &a| a.spread(&g, out))
    }
}

fn keep_first<T: AxisValue>(values: &mut Vec<T>) -> Option<(String, usize)> {
    let mut seen = HashSet::new();
    let mut repeated = HashSet::new();
    let mut first = None;
    values.retain(|v| {
        let shown = v.spell();
        if seen.contains(&shown) {
            if repeated.insert(shown.clone()) && first.is_none() {
                first = Some(shown);
            }
            false
        } else {
            seen.insert(shown);
            true
        }
    });
    first.map(|f| (f, repeated.len()))
}

fn spread<T: Copy>(points: Vec<Point>, values: &[T], set: impl Fn(&mut Point, T)) -> Vec<Point> {
    let mut next = Vec::with_capacity(points.len() * values.len());
    for p in points {
        for &v in values {
            let mut q = p;
            set(&mut q, v);
            next.push(q);
        }
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every axis reads back what it writes, on a grid and on a point, and
    /// its default is the default point's value.
    #[test]
    fn each_axis_reads_what_it_writes() {
        let mut g = Grid::default();
        g.frameworks_or(Framework::Memfit);
        let p = Point::default();
        for &a in Axis::ALL {
            let values = a.get(&g);
            assert_eq!(values, [a.of(&p)], "{}", a.key());
            let mut h = g.clone();
            a.set(&mut h, &values);
            assert_eq!(a.get(&h), values, "{}", a.key());
            let mut q = p;
            assert!(a.put(&mut q, &values[0]), "{}", a.key());
            assert_eq!(q, p, "{}", a.key());
            assert!(!a.put(&mut q, "no such value"), "{}", a.key());
        }
        let keys: HashSet<&str> = Axis::ALL.iter().map(|a| a.key()).collect();
        assert_eq!(keys.len(), Axis::ALL.len());
    }

    /// The grid's JSON has one list per axis, named by its key.
    #[test]
    fn the_grid_has_a_list_per_axis() {
        let json = serde_json::to_value(Grid::default()).unwrap();
        let mut keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        let mut axes: Vec<&str> = Axis::ALL.iter().map(|a| a.key()).collect();
        keys.sort_unstable();
        axes.sort_unstable();
        assert_eq!(keys, axes);
    }

    /// The first axis varies fastest; repeats are planned once.
    #[test]
    fn points_vary_the_first_axis_fastest() {
        let g: Grid = serde_yaml_ng::from_str(
            "micro_batch: [1, 2]\nprecision: [bf16, fp32, bf16]\nshard_group: [0, null, 8]\n",
        )
        .unwrap();
        let mut d = g.clone();
        let repeats = d.dedup();
        assert_eq!(
            repeats,
            [
                ("precision", "bf16".to_string(), 1),
                ("shard_group", "0".to_string(), 1)
            ]
        );
        assert_eq!(d.size(), Some(8));
        let pts = d.points();
        let got: Vec<String> = pts
            .iter()
            .map(|p| {
                format!(
                    "{}{}{}",
                    p.micro_batch,
                    p.precision.spell(),
                    p.shard_group.spell()
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                "1bf160", "2bf160", "1fp320", "2fp320", "1bf168", "2bf168", "1fp328", "2fp328"
            ]
        );
    }
}
