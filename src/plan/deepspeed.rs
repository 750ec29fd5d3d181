//! DeepSpeed's own closed forms for the memory of the model states under
//! ZeRO-2 and ZeRO-3, with and without offload: the figures its
//! `estimate_zero2_model_states_mem_needs` and
//! `estimate_zero3_model_states_mem_needs` print ("per CPU" for one node's
//! host, "per GPU"), which users compare a plan with. The formulas are
//! restated from DeepSpeed's `runtime/zero/stage_1_and_2.py` and
//! `runtime/zero/stage3.py` and its "Memory Requirements" documentation;
//! the planner prints them beside the engine's own figures, as it prints
//! the ZeRO paper's bytes per parameter. They cover parameters, gradients
//! and optimizer state only (no activations), with DeepSpeed's
//! `additional_buffer_factor` of 1.5 on host memory.

use serde::Serialize;

/// DeepSpeed's default `additional_buffer_factor`.
pub const BUFFER_FACTOR: f64 = 1.5;

/// One estimator row: bytes on one node's host and on one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Estimate {
    pub per_cpu: u64,
    pub per_gpu: u64,
}

/// `estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node,
/// num_nodes, cpu_offload)`: with offload the GPU keeps the 16-bit weights
/// (2 B/param) and the host 16 B/param of fp32 weights, gradients and Adam
/// state, or 4 B/param per GPU of the fp32 copy each process loads, the
/// larger; without, the GPU keeps 4 B/param plus 16 B/param sharded.
pub fn zero2(total_params: u64, gpus_per_node: u64, nodes: u64, cpu_offload: bool) -> Estimate {
    let p = total_params as f64;
    let gpus = (gpus_per_node * nodes) as f64;
    let (cpu, gpu) = if cpu_offload {
        (p * (4.0 * gpus).max(16.0) * BUFFER_FACTOR, 2.0 * p)
    } else {
        (
            p * 4.0 * gpus_per_node as f64 * BUFFER_FACTOR,
            4.0 * p + (16.0 * p / gpus).trunc(),
        )
    };
    Estimate {
        per_cpu: cpu as u64,
        per_gpu: gpu as u64,
    }
}

/// `estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
/// num_gpus_per_node, num_nodes, cpu_offload, cpu_offload_params,
/// zero_init)`: the GPU always holds the largest layer gathered in fp32
/// (4 B/param of it); the rest is 18 B/param (2 + 16) spread over the GPUs
/// or, offloaded, over the nodes' hosts.
pub fn zero3(
    total_params: u64,
    largest_layer_params: u64,
    gpus_per_node: u64,
    nodes: u64,
    offload: crate::engine::Offload,
    zero_init: bool,
) -> Estimate {
    let p = total_params as f64;
    let gpus = (gpus_per_node * nodes) as f64;
    let per_node = 1.0 / nodes as f64;
    let largest = 4.0 * largest_layer_params as f64;
    let loaded = 4.0 * gpus_per_node as f64;
    let (cpu, gpu) = match offload {
        crate::engine::Offload::OptimizerParams => (
            match zero_init {
                true => p * 18.0 * per_node * BUFFER_FACTOR,
                false => p * loaded.max(18.0 * per_node) * BUFFER_FACTOR,
            },
            largest,
        ),
        crate::engine::Offload::Optimizer => (
            match zero_init {
                true => p * 16.0 * per_node * BUFFER_FACTOR,
                false => p * loaded.max(16.0 * per_node) * BUFFER_FACTOR,
            },
            largest + (2.0 * p / gpus).trunc(),
        ),
        crate::engine::Offload::None => (
            match zero_init {
                true => largest_layer_params as f64 * loaded * BUFFER_FACTOR,
                false => p * loaded * BUFFER_FACTOR,
            },
            largest + (18.0 * p / gpus).trunc(),
        ),
    };
    Estimate {
        per_cpu: cpu as u64,
        per_gpu: gpu as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Offload;

    /// DeepSpeed prints `bytes / 2**30` with two decimals and calls it GB.
    fn gb(b: u64) -> f64 {
        b as f64 / (1u64 << 30) as f64
    }

    fn close(got: u64, printed: f64) {
        // DeepSpeed prints the inputs truncated to millions of parameters
        // (`int(total_params / 1e6)`) and the results to hundredths: up to
        // 1M parameters at 27 B each, about 0.03 GB, separate the two.
        assert!(
            (gb(got) - printed).abs() < 0.04,
            "{:.2} GB vs DeepSpeed's {printed}",
            gb(got)
        );
    }

    #[test]
    fn zero3_reproduces_the_t0_3b_table_in_the_hugging_face_deepspeed_guide() {
        // transformers' DeepSpeed guide, "Memory requirements": bigscience/T0_3B,
        // "2783M total params, 65M largest layer params", 1 node x 1 GPU.
        let (p, l) = (2783e6 as u64, 65e6 as u64);
        let rows = [
            (Offload::OptimizerParams, true, 70.00, 0.25),
            (Offload::OptimizerParams, false, 70.00, 0.25),
            (Offload::Optimizer, true, 62.23, 5.43),
            (Offload::Optimizer, false, 62.23, 5.43),
            (Offload::None, true, 0.37, 46.91),
            (Offload::None, false, 15.56, 46.91),
        ];
        for (offload, init, cpu, gpu) in rows {
            let e = zero3(p, l, 1, 1, offload, init);
            close(e.per_cpu, cpu);
            close(e.per_gpu, gpu);
        }
    }

    #[test]
    fn zero3_reproduces_a_published_llama_70b_run_on_4_nodes_of_12() {
        // A published estimate_zero3_model_states_mem_needs_all_live run for
        // Llama-3.3-70B-Instruct (AutoModel, so without lm_head): "69503M
        // total params, 1050M largest layer params", 4 nodes x 12 GPUs.
        let (p, l) = (69503e6 as u64, 1050e6 as u64);
        let rows = [
            (Offload::OptimizerParams, true, 436.93, 3.91),
            (Offload::OptimizerParams, false, 4660.54, 3.91),
            (Offload::Optimizer, true, 388.38, 6.61),
            (Offload::Optimizer, false, 4660.54, 6.61),
            (Offload::None, false, 4660.54, 28.19),
        ];
        for (offload, init, cpu, gpu) in rows {
            let e = zero3(p, l, 12, 4, offload, init);
            close(e.per_cpu, cpu);
            close(e.per_gpu, gpu);
        }
    }

    #[test]
    fn zero2_offload_keeps_only_16_bit_weights_on_the_gpu() {
        let p = 1_000_000_000;
        let e = zero2(p, 1, 1, true);
        assert_eq!(e.per_gpu, 2 * p);
        assert_eq!(e.per_cpu, 24 * p); // 16 B/param x 1.5
        // Eight GPUs: each process's fp32 copy (4 x 8 = 32 > 16) dominates.
        assert_eq!(zero2(p, 8, 1, true).per_cpu, 48 * p);
        let e = zero2(p, 8, 1, false);
        assert_eq!(e.per_gpu, 4 * p + 2 * p);
        assert_eq!(e.per_cpu, 48 * p);
    }
}
