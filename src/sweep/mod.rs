//! `memfit sweep`: measured trials over a recipe's grid, a recommendation, reports.

pub mod driver;
pub mod export;
pub mod html;
pub mod markdown;
pub mod plots;
pub mod retime;
pub mod slurm;
pub mod trial;
