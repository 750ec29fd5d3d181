//! memfit's integration tests, as one binary (as ripgrep's are): each module
//! here was a test crate of its own, and each linked the whole library, so
//! `cargo test` linked some 35 binaries of 60 MB. The tests run in one
//! process, on the test harness's threads, so none of them may change what
//! the process shares: environment variables go to child `Command`s, never
//! `std::env::set_var`; the working directory is never changed; each
//! scratch path has, besides the pid, a name no other test uses; and what a
//! test measures of the process (bytes read) it reads for its own thread.
//!
//! `cargo test --test it` runs them all; `cargo test --test it sweep::`
//! one former binary's, `cargo test --test it sweep::resume` one test.

mod common;

mod attention_kernels;
mod balance;
mod bounded_input;
mod calibration;
mod check;
mod cli;
mod cluster_plan;
mod compiled_loss;
mod cuda_cli;
mod cuda_double;
mod cuda_kernels;
mod engine;
mod expert_parallel;
mod fuzz_parsers;
mod gemm_shapes;
mod gemma;
mod gpu_calibration;
mod gradcheck;
mod help;
mod hf_import;
mod hf_reference;
mod hpz;
mod hybrid;
mod knobs;
mod liger;
mod lora;
mod lora_experts;
mod loss;
mod memory_bound;
mod moe;
mod multinode;
mod multiprocess;
mod nf4;
mod offload;
mod paged;
mod pipeline;
mod pipeline_cli;
mod plan;
mod plan_render;
mod pure_bf16;
mod qlora_experts;
mod sharding;
mod slurm;
mod sweep;
mod telemetry;
mod tensor_parallel;
mod topology;
mod watch;
