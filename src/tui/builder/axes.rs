//! The planner's grid axes as the builder edits them: each axis's values as
//! the recipe spells them, read from and written into a [`Grid`] and a
//! [`Point`], so that the form, the fit map, the neighbours and the fixes
//! share one table instead of seventeen matches.

use clap::ValueEnum;

use crate::engine::{
    Attention, Checkpointing, Finetune, Framework, Loss, Offload, Optimizer, Precision, Sharding,
};
use crate::plan::{Capacity, Grid, Point, name};

pub use crate::plan::Axis;

/// Every grid axis the planner has, in the order the form lists them.
pub const AXES: [Axis; 22] = [
    Axis::MicroBatch,
    Axis::Precision,
    Axis::Checkpointing,
    Axis::Attention,
    Axis::Optimizer,
    Axis::Sharding,
    Axis::Gpus,
    Axis::PipelineStages,
    Axis::VirtualStages,
    Axis::TensorParallel,
    Axis::SequenceParallel,
    Axis::TpCommOverlap,
    Axis::ShardGroup,
    Axis::HpzGroup,
    Axis::OverlapParamGather,
    Axis::Framework,
    Axis::Finetune,
    Axis::Offload,
    Axis::OffloadActivations,
    Axis::Loss,
    Axis::CapacityFactor,
    Axis::ExpertParallel,
];

fn names<T: ValueEnum>() -> Vec<String> {
    T::value_variants()
        .iter()
        .map(|v| name(v.clone()))
        .collect()
}

fn nums(v: &[usize]) -> Vec<String> {
    v.iter().map(usize::to_string).collect()
}

/// Group sizes as recipes spell them, 0 for off.
fn sizes(v: &[Option<std::num::NonZeroUsize>]) -> Vec<usize> {
    v.iter().map(|g| g.map_or(0, |g| g.get())).collect()
}

fn caps(v: &[Capacity]) -> Vec<String> {
    v.iter().map(|c| c.spelled()).collect()
}

/// How the builder shows each axis; what every axis shares (its key, its
/// values read and written) is `plan::Axis`'s.
impl Axis {
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
            Axis::VirtualStages => "virtual_stg",
            Axis::TensorParallel => "tensor_par",
            Axis::SequenceParallel => "seq_par",
            Axis::ShardGroup => "hybrid_grp",
            Axis::HpzGroup => "hpz_group",
            Axis::Framework => "framework",
            Axis::Finetune => "finetune",
            Axis::Offload => "offload",
            Axis::OffloadActivations => "offload_act",
            Axis::Loss => "loss",
            Axis::CapacityFactor => "capacity",
            Axis::ExpertParallel => "expert_par",
            Axis::TpCommOverlap => "tp_overlap",
            Axis::OverlapParamGather => "param_ovlp",
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
            Axis::VirtualStages => preset(&[1, 2, 3, 4], &grid.virtual_stages),
            Axis::TensorParallel => preset(&[1, 2, 4, 8], &grid.tensor_parallel),
            Axis::ExpertParallel => preset(&[1, 2, 4, 8], &grid.expert_parallel),
            Axis::ShardGroup => preset(&[0, 2, 4, 8], &sizes(&grid.shard_group)),
            Axis::HpzGroup => preset(&[0, 2, 4, 8], &sizes(&grid.hpz_group)),
            Axis::SequenceParallel
            | Axis::OffloadActivations
            | Axis::TpCommOverlap
            | Axis::OverlapParamGather => {
                vec!["false".into(), "true".into()]
            }
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

    /// How a point's value reads in a fit-map row label or a fix.
    pub fn show(self, v: &str) -> String {
        match self {
            Axis::MicroBatch => format!("mb{v}"),
            Axis::Gpus => format!("x{v}"),
            Axis::PipelineStages => format!("pp{v}"),
            Axis::VirtualStages => format!("vpp{v}"),
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
            Axis::OffloadActivations if v == "true" => "actoff".into(),
            Axis::OffloadActivations => "no-actoff".into(),
            Axis::TpCommOverlap if v == "true" => "tp-overlap".into(),
            Axis::TpCommOverlap => "no-tp-overlap".into(),
            Axis::OverlapParamGather if v == "true" => "param-gather-overlap".into(),
            Axis::OverlapParamGather => "no-param-gather-overlap".into(),
            Axis::CapacityFactor if v == "null" => "dropless".into(),
            Axis::CapacityFactor => format!("cf{v}"),
            Axis::ExpertParallel => format!("ep{v}"),
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
