//! QLoRA's NF4 weights on the GPU: the dequantisation kernel's launch
//! (`kernels/nf4.cu`) and its comparison case against the cpu backend.
//!
//! The weight lives in a `U8` buffer in [`crate::nf4::Nf4::to_bytes`]'s layout,
//! uploaded as is; `nf4_dequantize_kernel` writes the same values as
//! [`crate::nf4::dequantize_bytes`], bit for bit, rounded once to the output's
//! type, so the check demands exact equality.

use super::check::{FLOATS, Harness, both, down};
use super::driver::{Driver, LaunchCfg};
use super::{CudaBackend, CudaBuf, n64};
use crate::backend::{Backend, DType};

/// `out[..numel]` = the NF4 weight in `src` (a `U8` buffer of exactly
/// `nf4::storage_bytes(numel)`) dequantised, in `out`'s float type.
pub(crate) fn dequantize<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    src: &CudaBuf,
    numel: usize,
) {
    assert_eq!(
        src.dtype,
        DType::U8,
        "nf4_dequantize reads a U8 buffer, not {:?}",
        src.dtype
    );
    assert_eq!(
        src.len as u64,
        crate::nf4::storage_bytes(numel),
        "not an NF4 layout of {numel} values"
    );
    assert!(
        numel <= out.len,
        "nf4_dequantize of {numel} values into a buffer of {}",
        out.len
    );
    if numel == 0 {
        return;
    }
    be.launch(
        "nf4_dequantize_kernel",
        LaunchCfg::elementwise(numel.div_ceil(2)),
        &[out.arg(), out.dt(), src.arg(), n64(numel)],
    );
}

/// Quantises `x` on the host, uploads the bytes and dequantises them into a
/// buffer of `dt` two elements longer than `x` (filled with a sentinel first,
/// so a write past `numel` shows).
fn roundtrip<B: Backend>(be: &mut B, x: &[f32], dt: DType) -> Vec<Vec<f32>> {
    let bytes = crate::nf4::quantize(x).to_bytes();
    let mut w = be.alloc(bytes.len(), DType::U8);
    be.upload_u8(&mut w, &bytes);
    let mut out = be.alloc(x.len() + 2, dt);
    be.fill(&mut out, -7.0);
    be.nf4_dequantize(&mut out, &w, x.len());
    vec![down(be, &out)]
}

/// NF4 dequantisation against the cpu backend: sizes that end mid-byte,
/// mid-block and mid-group (and span several 256-block groups), every float
/// type, compared bit for bit.
pub(crate) fn check_cases<D: Driver>(h: &mut Harness<D>) {
    for &dt in &FLOATS {
        for n in [1usize, 63, 64, 64 * 256 + 5, 70_000] {
            // Normal values with a few blocks of zeros and outliers, so the
            // absmax codes cover the whole int8 range, zero blocks included.
            let mut x = h.randn(n, 0.5);
            for (b, chunk) in x.chunks_mut(crate::nf4::BLOCK).enumerate() {
                match b % 37 {
                    5 => chunk.fill(0.0),
                    11 => chunk[0] = 40.0,
                    _ => {}
                }
            }
            let (c, g) = both!(h, roundtrip(&x, dt));
            h.compare_exact(
                "nf4 dequantize (bitwise)",
                format!("n={n}"),
                dt,
                &["out"],
                &c,
                &g,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::check::tests::{assert_all_pass, harness};

    #[test]
    fn nf4_dequantize_matches_cpu_bit_for_bit_on_the_emulated_gpu() {
        let mut h = harness(11);
        check_cases(&mut h);
        assert_eq!(h.rows.len(), 15);
        assert_all_pass(&h);
    }

    /// Every one of the 16 codes through the kernel: its table is `nf4::NF4`.
    #[test]
    fn the_kernels_table_is_nf4s() {
        let mut h = harness(12);
        let mut want = crate::nf4::NF4.to_vec();
        want.extend([-7.0, -7.0]);
        let x = crate::nf4::NF4.to_vec();
        let (c, g) = both!(h, roundtrip(&x, DType::F32));
        let (c, g) = (&c[0], &g[0]);
        // One block holding each value once: absmax 1, every code exact, and
        // the two sentinels past the end untouched.
        assert_eq!(c, &want);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(g), bits(c));
    }

    #[test]
    fn a_wrong_layout_length_is_refused() {
        let mut h = harness(13);
        let w = h.gpu.alloc(10, DType::U8);
        let mut out = h.gpu.alloc(64, DType::F32);
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            h.gpu.nf4_dequantize(&mut out, &w, 64)
        }))
        .unwrap_err();
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("not an NF4 layout"), "{msg}");
    }
}
