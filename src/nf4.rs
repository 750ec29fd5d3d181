//! QLoRA's 4-bit NormalFloat (NF4) storage with double quantisation
//! (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023,
//! section 3), for a future QLoRA mode: the exact bytes a frozen NF4 weight
//! takes, and a cpu quantise/dequantise to check them against.
//!
//! Layout of one tensor of `numel` values:
//! - one 4-bit code per value into [`NF4`], two per byte;
//! - per 64-value block ([`BLOCK`]) its absmax, double-quantised to 8 bits;
//! - per 256 absmax values ([`ABSMAX_BLOCK`]) one fp32 scale;
//! - one fp32 mean of all the absmax values.
//!
//! Checked against tests/reference/nf4_reference.py by tests/it/nf4.rs.

/// First-level block: values sharing one absmax (QLoRA section 3, blocksize 64).
pub const BLOCK: usize = 64;

/// Second-level block: absmax values sharing one fp32 scale (QLoRA section 3,
/// double quantisation with blocksize 256).
pub const ABSMAX_BLOCK: usize = 256;

/// The 16 NF4 values, ascending, with an exact 0 at index 7: QLoRA Appendix E
/// (the same table as bitsandbytes' NF4). All are exact f32 values.
pub const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Index of 0.0 in [`NF4`]: the code of every value of an all-zero block.
pub const ZERO_CODE: u8 = 7;

/// Midpoints between adjacent NF4 values, in f32: (a + b) * 0.5.
const MIDPOINTS: [f32; 15] = {
    let mut m = [0.0f32; 15];
    let mut i = 0;
    while i < 15 {
        m[i] = (NF4[i] + NF4[i + 1]) * 0.5;
        i += 1;
    }
    m
};

/// A tensor stored as NF4 with double-quantised absmax (QLoRA section 3).
///
/// The absmax values use a symmetric linear int8 code: per group of 256,
/// `scale = max|absmax - mean| / 127` and
/// `code = round_half_away((absmax - mean) / scale)` in -127..=127
/// (all 0 with scale 0 when the group is constant). This is where it differs
/// from bitsandbytes, which uses its 8-bit dynamic (float-like) code here;
/// only the sizes (8 bits per 64-block, fp32 per 256 absmax values) are what
/// the paper counts. A dequantised absmax can come out negative or zero for
/// a block far below the mean; its values then dequantise to
/// `NF4[code] * that`, which the error bound in tests/it/nf4.rs allows for.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4 {
    /// Codes into [`NF4`], two per byte: value 2k in the high nibble, 2k+1 in
    /// the low one (bitsandbytes' order); an odd count leaves the last low
    /// nibble 0.
    packed: Vec<u8>,
    /// 8-bit code of each 64-block's absmax.
    absmax_codes: Vec<i8>,
    /// fp32 scale of each group of 256 absmax codes.
    absmax_scales: Vec<f32>,
    /// Mean of all the blocks' absmax, subtracted before the 8-bit code.
    absmax_mean: f32,
    numel: usize,
}

impl Nf4 {
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The packed codes (see the struct doc for the nibble order).
    pub fn packed(&self) -> &[u8] {
        &self.packed
    }

    /// The 4-bit code of value `i` (an index into [`NF4`]).
    pub fn code(&self, i: usize) -> u8 {
        assert!(i < self.numel, "index {i} out of {}", self.numel);
        let b = self.packed[i / 2];
        if i.is_multiple_of(2) {
            b >> 4
        } else {
            b & 0x0f
        }
    }

    pub fn absmax_codes(&self) -> &[i8] {
        &self.absmax_codes
    }

    pub fn absmax_scales(&self) -> &[f32] {
        &self.absmax_scales
    }

    pub fn absmax_mean(&self) -> f32 {
        self.absmax_mean
    }

    /// Dequantised absmax of 64-block `b`: `code * scale + mean` in f32.
    pub fn absmax(&self, b: usize) -> f32 {
        self.absmax_codes[b] as f32 * self.absmax_scales[b / ABSMAX_BLOCK] + self.absmax_mean
    }

    /// The layout as bytes, as a device buffer holds it: the packed codes,
    /// the absmax codes, the group scales and the mean (little-endian
    /// fp32); [`storage_bytes`]`(numel)` long. [`dequantize_bytes`] reads it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes() as usize);
        out.extend_from_slice(&self.packed);
        out.extend(self.absmax_codes.iter().map(|&c| c as u8));
        for s in &self.absmax_scales {
            out.extend_from_slice(&s.to_le_bytes());
        }
        out.extend_from_slice(&self.absmax_mean.to_le_bytes());
        out
    }

    /// Bytes this value's layout holds; equals [`storage_bytes`]`(numel)`.
    pub fn bytes(&self) -> u64 {
        (self.packed.len() + self.absmax_codes.len() + 4 * self.absmax_scales.len() + 4) as u64
    }
}

/// Index of the NF4 value nearest to `v` (|v| <= 1); at an exact midpoint,
/// the lower one.
fn nearest(v: f32) -> u8 {
    MIDPOINTS.partition_point(|&m| m < v) as u8
}

/// Quantise `x` (finite values) to NF4: per 64-block, the NF4 value nearest
/// to x / absmax; then the absmax values double-quantised (see [`Nf4`]).
/// The last block may be partial; an all-zero block gets [`ZERO_CODE`]s.
pub fn quantize(x: &[f32]) -> Nf4 {
    debug_assert!(x.iter().all(|v| v.is_finite()), "NF4 input not finite");
    let numel = x.len();
    let absmax: Vec<f32> = x
        .chunks(BLOCK)
        .map(|b| b.iter().fold(0.0f32, |m, v| m.max(v.abs())))
        .collect();
    let mut packed = vec![0u8; numel.div_ceil(2)];
    for (b, (chunk, &a)) in x.chunks(BLOCK).zip(&absmax).enumerate() {
        for (j, &v) in chunk.iter().enumerate() {
            let c = if a > 0.0 { nearest(v / a) } else { ZERO_CODE };
            let i = b * BLOCK + j;
            packed[i / 2] |= if i.is_multiple_of(2) { c << 4 } else { c };
        }
    }

    // Double quantisation (QLoRA section 3): subtract the mean of the absmax
    // values, then an 8-bit code per value with an fp32 scale per 256.
    let mut sum = 0.0f64;
    for &a in &absmax {
        sum += a as f64;
    }
    let absmax_mean = if absmax.is_empty() {
        0.0
    } else {
        (sum / absmax.len() as f64) as f32
    };
    let mut absmax_codes = Vec::with_capacity(absmax.len());
    let mut absmax_scales = Vec::with_capacity(absmax.len().div_ceil(ABSMAX_BLOCK));
    for group in absmax.chunks(ABSMAX_BLOCK) {
        let centred = group.iter().map(|&a| a - absmax_mean);
        let scale = centred.clone().fold(0.0f32, |m, d| m.max(d.abs())) / 127.0;
        absmax_scales.push(scale);
        absmax_codes.extend(centred.map(|d| {
            if scale > 0.0 {
                (d / scale).round().clamp(-127.0, 127.0) as i8
            } else {
                0
            }
        }));
    }
    Nf4 {
        packed,
        absmax_codes,
        absmax_scales,
        absmax_mean,
        numel,
    }
}

/// `NF4[code] * absmax(block)` for every value.
pub fn dequantize(q: &Nf4) -> Vec<f32> {
    let mut out = vec![0.0; q.numel];
    dequantize_into(q, &mut out);
    out
}

/// [`dequantize`] into `out`, which must hold exactly `q.numel()` values.
pub fn dequantize_into(q: &Nf4, out: &mut [f32]) {
    assert_eq!(out.len(), q.numel, "dequantize_into: wrong output length");
    for (b, chunk) in out.chunks_mut(BLOCK).enumerate() {
        let a = q.absmax(b);
        for (j, o) in chunk.iter_mut().enumerate() {
            *o = NF4[q.code(b * BLOCK + j) as usize] * a;
        }
    }
}

/// [`dequantize_into`] from [`Nf4::to_bytes`]'s layout: the same values,
/// bit for bit.
pub fn dequantize_bytes(bytes: &[u8], numel: usize, out: &mut [f32]) {
    assert_eq!(
        bytes.len() as u64,
        storage_bytes(numel),
        "not an NF4 layout of {numel} values"
    );
    assert_eq!(out.len(), numel, "dequantize_bytes: wrong output length");
    let blocks = numel.div_ceil(BLOCK);
    let (packed, rest) = bytes.split_at(numel.div_ceil(2));
    let (codes, rest) = rest.split_at(blocks);
    let f = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mean = f(&rest[rest.len() - 4..]);
    for (b, chunk) in out.chunks_mut(BLOCK).enumerate() {
        let scale = f(&rest[4 * (b / ABSMAX_BLOCK)..]);
        let a = codes[b] as i8 as f32 * scale + mean;
        for (j, o) in chunk.iter_mut().enumerate() {
            let i = b * BLOCK + j;
            let code = if i.is_multiple_of(2) {
                packed[i / 2] >> 4
            } else {
                packed[i / 2] & 0x0f
            };
            *o = NF4[code as usize] * a;
        }
    }
}

/// Exact bytes of the [`Nf4`] layout for `numel` values: ceil(numel/2) code
/// bytes, one byte per 64-block, 4 bytes per 256 blocks, 4 bytes of mean.
pub fn storage_bytes(numel: usize) -> u64 {
    let blocks = numel.div_ceil(BLOCK);
    (numel.div_ceil(2) + blocks + 4 * blocks.div_ceil(ABSMAX_BLOCK) + 4) as u64
}

/// Bits per value of [`storage_bytes`]; infinite for `numel` 0. Tends to
/// 4 + 8/64 + 32/(64*256) = 4.127 (QLoRA section 3).
pub fn bits_per_param(numel: usize) -> f64 {
    8.0 * storage_bytes(numel) as f64 / numel as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_ascending_with_exact_ends_and_zero() {
        assert!(NF4.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((NF4[0], NF4[ZERO_CODE as usize], NF4[15]), (-1.0, 0.0, 1.0));
        // the f32 literals are the Appendix E decimals, which are f32 values
        #[allow(clippy::excessive_precision)]
        let appendix_e: [f64; 16] = [
            -1.0,
            -0.6961928009986877,
            -0.5250730514526367,
            -0.39491748809814453,
            -0.28444138169288635,
            -0.18477343022823334,
            -0.09105003625154495,
            0.0,
            0.07958029955625534,
            0.16093020141124725,
            0.24611230194568634,
            0.33791524171829224,
            0.44070982933044434,
            0.5626170039176941,
            0.7229568362236023,
            1.0,
        ];
        for (&a, &b) in NF4.iter().zip(&appendix_e) {
            assert_eq!(a as f64, b);
        }
    }

    #[test]
    fn nearest_picks_the_closest_code_and_the_lower_on_ties() {
        for (k, &c) in NF4.iter().enumerate() {
            assert_eq!(nearest(c), k as u8);
        }
        for (k, &m) in MIDPOINTS.iter().enumerate() {
            assert_eq!(nearest(m), k as u8, "midpoint {k}");
            assert_eq!(nearest(m.next_up()), k as u8 + 1, "above midpoint {k}");
        }
        // brute force against argmin |v - NF4[k]| away from the midpoints
        for i in 0..=2000 {
            let v = -1.0 + i as f32 / 1000.0;
            let best = (0..16)
                .min_by(|&a, &b| (v - NF4[a]).abs().total_cmp(&(v - NF4[b]).abs()))
                .unwrap();
            assert_eq!(nearest(v) as usize, best, "v = {v}");
        }
    }

    #[test]
    fn packing_puts_the_even_value_in_the_high_nibble() {
        let q = quantize(&[-1.0, 1.0, 0.0]);
        assert_eq!(q.packed(), &[0x0f, 0x70]);
        assert_eq!((q.code(0), q.code(1), q.code(2)), (0, 15, ZERO_CODE));
        assert_eq!(dequantize(&q), vec![-1.0, 1.0, 0.0]);
    }

    #[test]
    fn zero_block_partial_block_and_empty() {
        let mut x = vec![0.0f32; BLOCK + 10];
        x[BLOCK + 3] = -2.0;
        x[BLOCK + 4] = 0.5;
        let q = quantize(&x);
        assert_eq!(q.absmax_codes().len(), 2);
        assert!((0..BLOCK).all(|i| q.code(i) == ZERO_CODE));
        let d = dequantize(&q);
        assert!(d[..BLOCK].iter().all(|&v| v == 0.0));
        assert!(
            (d[BLOCK + 3] + 2.0).abs() < 2.0 / 254.0 + 1e-6,
            "{}",
            d[BLOCK + 3]
        );
        assert_eq!(q.bytes(), storage_bytes(x.len()));

        let e = quantize(&[]);
        assert_eq!(e.numel(), 0);
        assert!(dequantize(&e).is_empty());
        assert_eq!(e.bytes(), storage_bytes(0));
    }

    #[test]
    fn storage_bytes_small_sizes() {
        assert_eq!(storage_bytes(0), 4);
        assert_eq!(storage_bytes(1), 1 + 1 + 4 + 4);
        assert_eq!(storage_bytes(64), 32 + 1 + 4 + 4);
        assert_eq!(storage_bytes(65), 33 + 2 + 4 + 4);
        assert_eq!(storage_bytes(64 * 256), 8192 + 256 + 4 + 4);
        assert_eq!(storage_bytes(64 * 256 + 1), 8193 + 257 + 8 + 4);
        for n in [1, 63, 64, 65, 1000, 16_384, 16_385, 40_001] {
            assert_eq!(
                quantize(&vec![0.25; n]).bytes(),
                storage_bytes(n),
                "n = {n}"
            );
        }
    }

    #[test]
    fn overhead_is_the_papers_0_127_bits() {
        let n = 1usize << 30; // 1 Gi parameters
        let overhead = bits_per_param(n) - 4.0;
        let paper = 8.0 / 64.0 + 32.0 / (64.0 * 256.0); // QLoRA section 3
        eprintln!("NF4 bits per parameter at 2^30: {}", bits_per_param(n));
        assert!((overhead - paper).abs() < 1e-7, "overhead {overhead}");
        assert!((overhead - 0.127).abs() < 5e-4, "overhead {overhead}");
        // small tensors pay more: a single block is 41 bytes for 64 values
        assert!((bits_per_param(64) - 41.0 * 8.0 / 64.0).abs() < 1e-12);
    }

    #[test]
    fn the_byte_layout_dequantises_bit_for_bit() {
        for n in [1usize, 63, 64, 1000, 64 * 256 + 5] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 113) as f32 / 17.0 - 3.0)
                .collect();
            let q = quantize(&x);
            let bytes = q.to_bytes();
            assert_eq!(bytes.len() as u64, storage_bytes(n));
            let mut out = vec![0.0; n];
            dequantize_bytes(&bytes, n, &mut out);
            assert_eq!(out, dequantize(&q), "{n} values");
        }
    }
}
