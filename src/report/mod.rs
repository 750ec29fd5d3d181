//! The documents memfit writes and reads back: `memfit run`'s report
//! (`run`) and a sweep's (`sweep`, which `memfit check` compares).

pub mod run;
pub mod sweep;
