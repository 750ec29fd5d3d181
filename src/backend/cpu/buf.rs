//! Host buffers ([`CpuBuf`]) and the ops that move data in and out of them:
//! the caching allocator, uploads, NF4 dequantisation, conversions between
//! float widths, copies and fills. Kernels compute on 16-bit buffers in f32
//! through [`WideMut`], which rounds once on the way back.

use std::borrow::Cow;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use super::CpuBackend;
use super::math::{ELEMS_PER_TASK, add_assign};
use crate::backend::DType;

/// A host buffer: `f32` or 16-bit float data, `u32` token ids, `u8` codes.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    U32(Vec<u32>),
    U8(Vec<u8>),
}

/// A float buffer seen as `f32` for the length of one kernel. An `f32` buffer
/// is borrowed as it is; a 16-bit one is widened into a scratch copy, and the
/// scratch is rounded back (to nearest even) into the 16-bit storage when the
/// view drops, at the end of the kernel. That is where a GPU kernel rounds: it
/// loads 16-bit values, computes in fp32 registers, and stores 16-bit results
/// (cuBLAS with fp32 compute type, including `C = AB + C` accumulation).
pub enum WideMut<'a> {
    Direct(&'a mut [f32]),
    Staged { buf: &'a mut CpuBuf, tmp: Vec<f32> },
}

impl std::ops::Deref for WideMut<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            WideMut::Direct(s) => s,
            WideMut::Staged { tmp, .. } => tmp,
        }
    }
}

impl std::ops::DerefMut for WideMut<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            WideMut::Direct(s) => s,
            WideMut::Staged { tmp, .. } => tmp,
        }
    }
}

impl Drop for WideMut<'_> {
    fn drop(&mut self) {
        if let WideMut::Staged { buf, tmp } = self {
            match buf {
                CpuBuf::Bf16(v) => v.convert_from_f32_slice(tmp),
                CpuBuf::F16(v) => v.convert_from_f32_slice(tmp),
                _ => unreachable!("only 16-bit buffers are staged"),
            }
        }
    }
}

impl CpuBuf {
    pub fn dtype(&self) -> DType {
        match self {
            CpuBuf::F32(_) => DType::F32,
            CpuBuf::Bf16(_) => DType::Bf16,
            CpuBuf::F16(_) => DType::F16,
            CpuBuf::U32(_) => DType::U32,
            CpuBuf::U8(_) => DType::U8,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CpuBuf::F32(v) => v.len(),
            CpuBuf::Bf16(v) => v.len(),
            CpuBuf::F16(v) => v.len(),
            CpuBuf::U32(v) => v.len(),
            CpuBuf::U8(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `f32` contents. Panics on another dtype: the engine passed the wrong buffer.
    pub fn as_f32(&self) -> &[f32] {
        match self {
            CpuBuf::F32(v) => v,
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// The `f32` contents, mutable. Panics on another dtype.
    pub fn as_f32_mut(&mut self) -> &mut [f32] {
        match self {
            CpuBuf::F32(v) => v,
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// A float buffer's values as `f32`: borrowed for `f32`, widened (exactly)
    /// for 16-bit. Panics on an integer buffer.
    pub fn wide(&self) -> Cow<'_, [f32]> {
        match self {
            CpuBuf::F32(v) => Cow::Borrowed(v),
            CpuBuf::Bf16(v) => Cow::Owned(v.to_f32_vec()),
            CpuBuf::F16(v) => Cow::Owned(v.to_f32_vec()),
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// A float buffer as mutable `f32`; 16-bit results are rounded back when
    /// the view drops (see [`WideMut`]). Panics on an integer buffer.
    pub fn wide_mut(&mut self) -> WideMut<'_> {
        match self {
            CpuBuf::F32(v) => WideMut::Direct(v),
            CpuBuf::Bf16(v) => {
                let tmp = v.to_f32_vec();
                WideMut::Staged { buf: self, tmp }
            }
            CpuBuf::F16(v) => {
                let tmp = v.to_f32_vec();
                WideMut::Staged { buf: self, tmp }
            }
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// Elements `off..off + n` of a float buffer as `f32` (only that range is widened).
    pub fn read_range(&self, off: usize, n: usize) -> Cow<'_, [f32]> {
        match self {
            CpuBuf::F32(v) => Cow::Borrowed(&v[off..off + n]),
            CpuBuf::Bf16(v) => Cow::Owned(v[off..off + n].to_f32_vec()),
            CpuBuf::F16(v) => Cow::Owned(v[off..off + n].to_f32_vec()),
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// Stores `vals` at `off..` (rounded to nearest even into a 16-bit buffer),
    /// or adds them in f32 and stores the rounded sums when `accumulate`.
    pub fn write_range(&mut self, off: usize, vals: &[f32], accumulate: bool) {
        let n = vals.len();
        match self {
            CpuBuf::F32(v) if accumulate => add_assign(&mut v[off..off + n], vals),
            CpuBuf::F32(v) => v[off..off + n].copy_from_slice(vals),
            CpuBuf::Bf16(v) => store_rounded(&mut v[off..off + n], vals, accumulate),
            CpuBuf::F16(v) => store_rounded(&mut v[off..off + n], vals, accumulate),
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// The `u32` contents. Panics on another dtype.
    pub fn as_u32(&self) -> &[u32] {
        match self {
            CpuBuf::U32(v) => v,
            other => dtype_mismatch(DType::U32, other.dtype()),
        }
    }

    /// The `u32` contents, mutable. Panics on another dtype.
    pub fn as_u32_mut(&mut self) -> &mut [u32] {
        match self {
            CpuBuf::U32(v) => v,
            other => dtype_mismatch(DType::U32, other.dtype()),
        }
    }

    /// The `u8` contents, mutable. Panics on another dtype.
    pub fn as_u8_mut(&mut self) -> &mut [u8] {
        match self {
            CpuBuf::U8(v) => v,
            other => dtype_mismatch(DType::U8, other.dtype()),
        }
    }
}

/// `dst = round(vals)` or `dst = round(dst + vals)`, the sum taken in f32.
fn store_rounded<H>(dst: &mut [H], vals: &[f32], accumulate: bool)
where
    [H]: HalfFloatSliceExt,
{
    if accumulate {
        let mut sum = dst.to_f32_vec();
        add_assign(&mut sum, vals);
        dst.convert_from_f32_slice(&sum);
    } else {
        dst.convert_from_f32_slice(vals);
    }
}

#[cold]
#[track_caller]
pub(super) fn dtype_mismatch(want: DType, got: DType) -> ! {
    panic!(
        "cpu backend: expected a {want:?} buffer, got a {got:?} buffer (engine bug: wrong buffer passed to an op)"
    )
}

pub(super) fn alloc(be: &mut CpuBackend, len: usize, dtype: DType) -> CpuBuf {
    if let Some(mut buf) = be.cache.get_mut(&(dtype, len)).and_then(Vec::pop) {
        match &mut buf {
            CpuBuf::F32(v) => be
                .pool
                .install(|| v.par_chunks_mut(ELEMS_PER_TASK).for_each(|c| c.fill(0.0))),
            CpuBuf::Bf16(v) => v.fill(bf16::ZERO),
            CpuBuf::F16(v) => v.fill(f16::ZERO),
            CpuBuf::U32(v) => v.fill(0),
            CpuBuf::U8(v) => v.fill(0),
        }
        return buf;
    }
    match dtype {
        DType::F32 => CpuBuf::F32(vec![0.0; len]),
        DType::Bf16 => CpuBuf::Bf16(vec![bf16::ZERO; len]),
        DType::F16 => CpuBuf::F16(vec![f16::ZERO; len]),
        DType::U32 => CpuBuf::U32(vec![0; len]),
        DType::U8 => CpuBuf::U8(vec![0; len]),
    }
}

pub(super) fn free(be: &mut CpuBackend, buf: CpuBuf) {
    let key = (buf.dtype(), buf.len());
    be.cache.entry(key).or_default().push(buf);
}

/// Copies `src` into the start of `dst` (which must be at least as long),
/// rounding to nearest even when `dst` is 16-bit.
pub(super) fn upload_f32(_: &mut CpuBackend, dst: &mut CpuBuf, src: &[f32]) {
    assert!(
        src.len() <= dst.len(),
        "upload of {} f32 into a buffer of {}",
        src.len(),
        dst.len()
    );
    match dst {
        CpuBuf::F32(d) => d[..src.len()].copy_from_slice(src),
        CpuBuf::Bf16(d) => d[..src.len()].convert_from_f32_slice(src),
        CpuBuf::F16(d) => d[..src.len()].convert_from_f32_slice(src),
        other => dtype_mismatch(DType::F32, other.dtype()),
    }
}

pub(super) fn upload_u8(_: &mut CpuBackend, dst: &mut CpuBuf, src: &[u8]) {
    match dst {
        CpuBuf::U8(d) => d[..src.len()].copy_from_slice(src),
        other => dtype_mismatch(DType::U8, other.dtype()),
    }
}

pub(super) fn nf4_dequantize(_: &mut CpuBackend, out: &mut CpuBuf, src: &CpuBuf, numel: usize) {
    let CpuBuf::U8(bytes) = src else {
        dtype_mismatch(DType::U8, src.dtype())
    };
    let mut wide = out.wide_mut();
    crate::nf4::dequantize_bytes(bytes, numel, &mut wide[..numel]);
}

pub(super) fn upload_u32(_: &mut CpuBackend, dst: &mut CpuBuf, src: &[u32]) {
    let dst = dst.as_u32_mut();
    assert!(
        src.len() <= dst.len(),
        "upload of {} u32 into a buffer of {}",
        src.len(),
        dst.len()
    );
    dst[..src.len()].copy_from_slice(src);
}

pub(super) fn copy_slice(
    _: &mut CpuBackend,
    dst: &mut CpuBuf,
    dst_off: usize,
    src: &CpuBuf,
    src_off: usize,
    n: usize,
    accumulate: bool,
) {
    if n > 0 {
        dst.write_range(dst_off, &src.read_range(src_off, n), accumulate);
    }
}

pub(super) fn convert(be: &mut CpuBackend, dst: &mut CpuBuf, src: &CpuBuf, n: usize) {
    let src = &src.wide()[..n];
    be.pool.install(|| match dst {
        CpuBuf::F32(d) => d[..n].copy_from_slice(src),
        CpuBuf::Bf16(d) => d[..n]
            .par_chunks_mut(ELEMS_PER_TASK)
            .zip(src.par_chunks(ELEMS_PER_TASK))
            .for_each(|(d, s)| d.convert_from_f32_slice(s)),
        CpuBuf::F16(d) => d[..n]
            .par_chunks_mut(ELEMS_PER_TASK)
            .zip(src.par_chunks(ELEMS_PER_TASK))
            .for_each(|(d, s)| d.convert_from_f32_slice(s)),
        other => dtype_mismatch(DType::F32, other.dtype()),
    });
}

pub(super) fn fill(be: &mut CpuBackend, buf: &mut CpuBuf, value: f32) {
    let mut buf = buf.wide_mut();
    be.pool.install(|| {
        buf.par_chunks_mut(ELEMS_PER_TASK)
            .for_each(|c| c.fill(value))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    #[test]
    fn buffers_alloc_fill_upload_download() {
        let mut be = be(2);
        let s = AttnShape {
            b: 2,
            t: 8,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 4,
        };
        assert_eq!(be.workspace_bytes(s, false, DType::F32), 0);
        let mut a = be.alloc(5, DType::F32);
        assert_eq!(be.download_f32(&a).unwrap(), vec![0.0; 5]);
        be.fill(&mut a, 1.5);
        assert_eq!(be.download_f32(&a).unwrap(), vec![1.5; 5]);
        be.upload_f32(&mut a, &[1.0, 2.0]);
        assert_eq!(be.download_f32(&a).unwrap(), vec![1.0, 2.0, 1.5, 1.5, 1.5]);
        let mut t = be.alloc(3, DType::U32);
        assert_eq!(t.dtype(), DType::U32);
        be.upload_u32(&mut t, &[7, 8, 9]);
        assert_eq!(t.as_u32(), &[7, 8, 9]);
        be.free(a);
        assert!(CpuBackend::new(0).is_err());
    }

    #[test]
    #[should_panic(expected = "expected a F32 buffer, got a U32 buffer")]
    fn dtype_mismatch_panics() {
        let _ = CpuBuf::U32(vec![1]).as_f32();
    }

    /// 16-bit storage: a kernel reads 16-bit values, computes in f32 and rounds
    /// each stored result once (to nearest even), including when it accumulates.
    #[test]
    fn sixteen_bit_buffers_round_once_on_store() {
        let mut be = be(2);
        let mut r = Rng(0x5eed_1234);
        let (n, c, oc) = (5, 24, 7);
        let (x, w, dy) = (r.vec(n * c), r.vec(oc * c), r.vec(n * oc));
        for dt in [DType::Bf16, DType::F16] {
            let round = |v: &[f32]| -> Vec<f32> {
                let mut one = CpuBackend::new(1).unwrap();
                let mut b = one.alloc(v.len(), dt);
                one.upload_f32(&mut b, v);
                b.wide().into_owned()
            };
            // inputs as the 16-bit buffers hold them
            let (xr, wr, dyr) = (round(&x), round(&w), round(&dy));
            let mut x16 = be.alloc(n * c, dt);
            let mut w16 = be.alloc(oc * c, dt);
            let mut dy16 = be.alloc(n * oc, dt);
            be.upload_f32(&mut x16, &x);
            be.upload_f32(&mut w16, &w);
            be.upload_f32(&mut dy16, &dy);
            assert_eq!(x16.dtype(), dt);
            assert_eq!(x16.wide().as_ref(), xr.as_slice());

            // forward: the f32 result on the widened inputs, rounded once
            let mut out16 = be.alloc(n * oc, dt);
            be.matmul_forward(&mut out16, &x16, &w16, None, n, c, oc);
            let mut out32 = zeros(n * oc);
            be.matmul_forward(&mut out32, &f(&xr), &f(&wr), None, n, c, oc);
            assert_eq!(out16.wide().as_ref(), round(out32.as_f32()).as_slice());

            // backward accumulates dw twice: each add in f32 from the stored
            // 16-bit value, rounded when stored
            let mut dw16 = be.alloc(oc * c, dt);
            let mut dx16 = be.alloc(n * c, dt);
            let mut dw32 = zeros(oc * c);
            let mut dx32 = zeros(n * c);
            for _ in 0..2 {
                be.matmul_backward(
                    &mut dx16,
                    Some(&mut dw16),
                    None,
                    &dy16,
                    &x16,
                    &w16,
                    n,
                    c,
                    oc,
                );
                be.matmul_backward(
                    &mut dx32,
                    Some(&mut dw32),
                    None,
                    &f(&dyr),
                    &f(&xr),
                    &f(&wr),
                    n,
                    c,
                    oc,
                );
                let rounded = round(dw32.as_f32());
                assert_eq!(dw16.wide().as_ref(), rounded.as_slice());
                dw32 = f(&rounded);
            }
            assert_eq!(dx16.wide().as_ref(), round(dx32.as_f32()).as_slice());

            // master -> working weights
            let mut back = be.alloc(oc * c, dt);
            be.convert(&mut back, &f(&w), oc * c);
            assert_eq!(back, w16);
        }
        // fp16 overflows to inf past 65504; bf16 keeps fp32's range
        let mut h = be.alloc(2, DType::F16);
        be.upload_f32(&mut h, &[65504.0, 70000.0]);
        assert_eq!(h.wide().as_ref(), &[65504.0, f32::INFINITY]);
        let mut b = be.alloc(1, DType::Bf16);
        be.upload_f32(&mut b, &[1e30]);
        assert!(b.wide()[0].is_finite());
    }
}
