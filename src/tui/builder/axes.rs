//! The planner's grid axes as the builder edits them: each axis's values as
//! the recipe spells them, read from and written into a [`Grid`] and a
//! [`Point`], so that the form, the fit map, the neighbours and the fixes
//! share one table instead of seventeen matches.

use clap::ValueEnum;

use crate::config::knobs::group;
use crate::engine::{
    Attention, Checkpointing, Finetune, Framework, Loss, Offload, Optimizer, Precision, Sharding,
};
use crate::plan::{Capacity, Grid, Point, name};

/// Every grid axis the planner has, in the order the form lists them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    MicroBatch,
    Precision,
    Checkpointing,
    Attention,
    Optimizer,
    Sharding,
    Gpus,
    PipelineStages,
    TensorParallel,
    SequenceParallel,
    ShardGroup,
    HpzGroup,
    Framework,
    Finetune,
    Offload,
    Loss,
    CapacityFactor,
}

pub const AXES: [Axis; 17] = [
    Axis::MicroBatch,
    Axis::Precision,
    Axis::Checkpointing,
    Axis::Attention,
    Axis::Optimizer,
    Axis::Sharding,
    Axis::Gpus,
    Axis::PipelineStages,
    Axis::TensorParallel,
    Axis::SequenceParallel,
    Axis::ShardGroup,
    Axis::HpzGroup,
    Axis::Framework,
    Axis::Finetune,
    Axis::Offload,
    Axis::Loss,
    Axis::CapacityFactor,
];

fn names<T: ValueEnum>() -> Vec<String> {
    T::value_variants()
        .iter()
        .map(|v| name(v.clone()))
        .collect()
}

fn parse<T: ValueEnum>(s: &str) -> Option<T> {
    T::from_str(s, false).ok()
}

fn nums(v: &[usize]) -> Vec<String> {
    v.iter().map(usize::to_string).collect()
}

fn set_nums(s: &[String]) -> Vec<usize> {
    s.iter().filter_map(|x| x.parse().ok()).collect()
}

/// Group sizes as recipes spell them, 0 for off.
fn sizes(v: &[Option<std::num::NonZeroUsize>]) -> Vec<usize> {
    v.iter().map(|g| g.map_or(0, |g| g.get())).collect()
}

fn set_groups(s: &[String]) -> Vec<Option<std::num::NonZeroUsize>> {
    set_nums(s).into_iter().map(group::from_size).collect()
}

fn caps(v: &[Capacity]) -> Vec<String> {
    v.iter().map(|c| c.spelled()).collect()
}

fn set_enum<T: ValueEnum>(s: &[String]) -> Vec<T> {
    s.iter().filter_map(|x| parse(x)).collect()
}

impl Axis {
    /// The recipe's key.
    pub fn key(self) -> &'static str {
        match self {
            Axis::MicroBatch => "micro_batch",
            Axis::Precision => "precision",
            Axis::Checkpointing => "checkpointing",
            Axis::Attention => "attention",
            Axis::Optimizer => "optimizer",
            Axis::Sharding => "sharding",
            Axis::Gpus => "gpus",
            Axis::PipelineStages => "pipeline_stages",
            Axis::TensorParallel => "tensor_parallel",
            Axis::SequenceParallel => "sequence_parallel",
            Axis::ShardGroup => "shard_group",
            Axis::HpzGroup => "hpz_group",
            Axis::Framework => "framework",
            Axis::Finetune => "finetune",
            Axis::Offload => "offload",
            Axis::Loss => "loss",
            Axis::CapacityFactor => "capacity_factor",
        }
    }

    /// The form's label (at most 11 columns).
    pub fn label(self) -> &'static str {
        match self {
            Axis::MicroBatch => "micro_batch",
            Axis::Precision => "precision",
            Axis::Checkpointing => "checkpoint",
            Axis::Attention => "attention",
            Axis::Optimizer => "optimizer",
            Axis::Sharding => "sharding",
            Axis::Gpus => "gpus",
            Axis::PipelineStages => "pipeline",
            Axis::TensorParallel => "tensor_par",
            Axis::SequenceParallel => "seq_par",
            Axis::ShardGroup => "hybrid_grp",
            Axis::HpzGroup => "hpz_group",
            Axis::Framework => "framework",
            Axis::Finetune => "finetune",
            Axis::Offload => "offload",
            Axis::Loss => "loss",
            Axis::CapacityFactor => "capacity",
        }
    }

    /// The values offered: every variant of a knob, a preset list for a
    /// number (a value already in `grid` outside the list joins it).
    pub fn options(self, grid: &Grid) -> Vec<String> {
        let preset = |p: &[usize], have: &[usize]| {
            let mut v: Vec<usize> = p.to_vec();
            v.extend(have.iter().filter(|x| !p.contains(x)));
            v.sort_unstable();
            nums(&v)
        };
        match self {
            Axis::MicroBatch => preset(&[1, 2, 4, 8, 16, 32, 64], &grid.micro_batch),
            Axis::Gpus => preset(&[1, 2, 4, 8, 16, 32, 64, 128], &grid.gpus),
            Axis::PipelineStages => preset(&[1, 2, 4, 8], &grid.pipeline_stages),
            Axis::TensorParallel => preset(&[1, 2, 4, 8], &grid.tensor_parallel),
            Axis::ShardGroup => preset(&[0, 2, 4, 8], &sizes(&grid.shard_group)),
            Axis::HpzGroup => preset(&[0, 2, 4, 8], &sizes(&grid.hpz_group)),
            Axis::SequenceParallel => vec!["false".into(), "true".into()],
            Axis::Precision => names::<Precision>(),
            Axis::Checkpointing => names::<Checkpointing>(),
            Axis::Attention => names::<Attention>(),
            Axis::Optimizer => names::<Optimizer>(),
            Axis::Sharding => names::<Sharding>(),
            Axis::Framework => names::<Framework>(),
            Axis::Finetune => names::<Finetune>(),
            Axis::Offload => names::<Offload>(),
            Axis::Loss => names::<Loss>(),
            Axis::CapacityFactor => {
                // Dropless first, then the factors by size.
                let preset = [None, Some(100), Some(125), Some(150), Some(200)].map(Capacity);
                let mut v = preset.to_vec();
                v.extend(grid.capacity_factor.iter().filter(|x| !preset.contains(x)));
                v.sort_unstable();
                v.dedup();
                caps(&v)
            }
        }
    }

    /// The values the grid has on this axis, as the recipe spells them.
    pub fn get(self, g: &Grid) -> Vec<String> {
        match self {
            Axis::MicroBatch => nums(&g.micro_batch),
            Axis::Gpus => nums(&g.gpus),
            Axis::PipelineStages => nums(&g.pipeline_stages),
            Axis::TensorParallel => nums(&g.tensor_parallel),
            Axis::ShardGroup => nums(&sizes(&g.shard_group)),
            Axis::HpzGroup => nums(&sizes(&g.hpz_group)),
            Axis::SequenceParallel => g.sequence_parallel.iter().map(bool::to_string).collect(),
            Axis::Precision => g.precision.iter().map(|v| name(*v)).collect(),
            Axis::Checkpointing => g.checkpointing.iter().map(|v| name(*v)).collect(),
            Axis::Attention => g.attention.iter().map(|v| name(*v)).collect(),
            Axis::Optimizer => g.optimizer.iter().map(|v| name(*v)).collect(),
            Axis::Sharding => g.sharding.iter().map(|v| name(*v)).collect(),
            Axis::Framework => g.framework.iter().map(|v| name(*v)).collect(),
            Axis::Finetune => g.finetune.iter().map(|v| name(*v)).collect(),
            Axis::Offload => g.offload.iter().map(|v| name(*v)).collect(),
            Axis::Loss => g.loss.iter().map(|v| name(*v)).collect(),
            Axis::CapacityFactor => caps(&g.capacity_factor),
        }
    }

    /// Puts `values` (recipe spellings; unknown ones are dropped) on this axis.
    pub fn set(self, g: &mut Grid, values: &[String]) {
        match self {
            Axis::MicroBatch => g.micro_batch = set_nums(values),
            Axis::Gpus => g.gpus = set_nums(values),
            Axis::PipelineStages => g.pipeline_stages = set_nums(values),
            Axis::TensorParallel => g.tensor_parallel = set_nums(values),
            Axis::ShardGroup => g.shard_group = set_groups(values),
            Axis::HpzGroup => g.hpz_group = set_groups(values),
            Axis::SequenceParallel => {
                g.sequence_parallel = values.iter().filter_map(|v| v.parse().ok()).collect()
            }
            Axis::Precision => g.precision = set_enum(values),
            Axis::Checkpointing => g.checkpointing = set_enum(values),
            Axis::Attention => g.attention = set_enum(values),
            Axis::Optimizer => g.optimizer = set_enum(values),
            Axis::Sharding => g.sharding = set_enum(values),
            Axis::Framework => g.framework = set_enum(values),
            Axis::Finetune => g.finetune = set_enum(values),
            Axis::Offload => g.offload = set_enum(values),
            Axis::Loss => g.loss = set_enum(values),
            Axis::CapacityFactor => {
                g.capacity_factor = values.iter().filter_map(|v| v.parse().ok()).collect()
            }
        }
    }

    /// A point's value on this axis.
    pub fn of(self, p: &Point) -> String {
        match self {
            Axis::MicroBatch => p.micro_batch.to_string(),
            Axis::Gpus => p.gpus.to_string(),
            Axis::PipelineStages => p.pipeline_stages.to_string(),
            Axis::TensorParallel => p.tensor_parallel.to_string(),
            Axis::ShardGroup => group::spelled(p.shard_group),
            Axis::HpzGroup => group::spelled(p.hpz_group),
            Axis::SequenceParallel => p.sequence_parallel.to_string(),
            Axis::Precision => name(p.precision),
            Axis::Checkpointing => name(p.checkpointing),
            Axis::Attention => name(p.attention),
            Axis::Optimizer => name(p.optimizer),
            Axis::Sharding => name(p.sharding),
            Axis::Framework => name(p.framework),
            Axis::Finetune => name(p.finetune),
            Axis::Offload => name(p.offload),
            Axis::Loss => name(p.loss),
            Axis::CapacityFactor => p.capacity_factor.spelled(),
        }
    }

    /// Sets a point's value on this axis; false when `v` is no value of it.
    pub fn put(self, p: &mut Point, v: &str) -> bool {
        fn n(v: &str, f: impl FnOnce(usize)) -> bool {
            v.parse().map(f).is_ok()
        }
        fn e<T: ValueEnum>(v: &str, f: impl FnOnce(T)) -> bool {
            parse(v).map(f).is_some()
        }
        match self {
            Axis::MicroBatch => n(v, |x| p.micro_batch = x),
            Axis::Gpus => n(v, |x| p.gpus = x),
            Axis::PipelineStages => n(v, |x| p.pipeline_stages = x),
            Axis::TensorParallel => n(v, |x| p.tensor_parallel = x),
            Axis::ShardGroup => n(v, |x| p.shard_group = group::from_size(x)),
            Axis::HpzGroup => n(v, |x| p.hpz_group = group::from_size(x)),
            Axis::SequenceParallel => v.parse().map(|x| p.sequence_parallel = x).is_ok(),
            Axis::Precision => e(v, |x| p.precision = x),
            Axis::Checkpointing => e(v, |x| p.checkpointing = x),
            Axis::Attention => e(v, |x| p.attention = x),
            Axis::Optimizer => e(v, |x| p.optimizer = x),
            Axis::Sharding => e(v, |x| p.sharding = x),
            Axis::Framework => e(v, |x| p.framework = x),
            Axis::Finetune => e(v, |x| p.finetune = x),
            Axis::Offload => e(v, |x| p.offload = x),
            Axis::Loss => e(v, |x| p.loss = x),
            Axis::CapacityFactor => v.parse().map(|x| p.capacity_factor = x).is_ok(),
        }
    }

    /// How a point's value reads in a fit-map row label or a fix.
    pub fn show(self, v: &str) -> String {
        match self {
            Axis::MicroBatch => format!("mb{v}"),
            Axis::Gpus => format!("x{v}"),
            Axis::PipelineStages => format!("pp{v}"),
            Axis::TensorParallel => format!("tp{v}"),
            Axis::ShardGroup if v == "0" => "no-hybrid".into(),
            Axis::ShardGroup => format!("hybrid{v}"),
            Axis::HpzGroup if v == "0" => "no-hpz".into(),
            Axis::HpzGroup => format!("hpz{v}"),
            Axis::SequenceParallel if v == "true" => "sp".into(),
            Axis::SequenceParallel => "no-sp".into(),
            Axis::Checkpointing if v == "none" => "nockpt".into(),
            Axis::Checkpointing => format!("ckpt:{v}"),
            Axis::Offload => format!("offload:{v}"),
            Axis::CapacityFactor if v == "null" => "dropless".into(),
            Axis::CapacityFactor => format!("cf{v}"),
            _ => v.to_string(),
        }
    }
}

/// `point` with the accumulation its micro-batch and layout give at
/// `global_batch`, as `plan::expand` sets it.
pub fn with_accum(mut p: Point, global_batch: usize) -> Point {
    p.grad_accum = crate::plan::grad_accum(&p, global_batch);
    p
}

/// Two points with the same knobs (the derived accumulation aside).
pub fn same_knobs(a: &Point, b: &Point) -> bool {
    AXES.iter().all(|x| x.of(a) == x.of(b))
}
