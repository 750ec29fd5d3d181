//! Each kernel call described once, for the cost layer: its name, the
//! FLOPs it does, the bytes it moves and the shape class that decides how
//! fast a GPU runs it ([`Work`]). [`Device`](super::device::Device)'s op
//! methods build one of these per backend call and hand it to the meter,
//! which prices it on the device's [`Roofline`](super::device::Roofline):
//! a GEMM by its M, N and K, an attention kernel at its own efficiency,
//! everything else by its bytes and its FLOPs.

use crate::backend::AttnShape;

/// One GEMM shape, run `count` times (a batched or grouped GEMM, or the two
/// of a backward pass with the same shape): `C[m×n] = A[m×k] · B[k×n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub count: usize,
}

impl Gemm {
    pub fn new(m: usize, n: usize, k: usize) -> Gemm {
        Gemm { m, n, k, count: 1 }
    }

    /// 2·m·n·k per GEMM (a multiply and an add per term).
    pub fn flops(&self) -> u64 {
        2 * (self.m * self.n) as u64 * self.k as u64 * self.count as u64
    }
}

/// What kind of kernel a call is, for its price.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Tensor-core GEMMs (a backward pass has two: the input's gradient and
    /// the weight's); FLOPs beyond theirs (a bias gradient) are priced as a
    /// streaming kernel's.
    Gemm([Option<Gemm>; 2]),
    /// A fused (flash) attention kernel over sequences of `t` tokens with
    /// heads of `head_dim`: its own rate, which published rates read by
    /// both and a measured curve by `t`.
    FusedAttention { t: usize, head_dim: usize },
    /// A normalization kernel (LayerNorm, RMSNorm, forward or backward):
    /// each row reduced, then written. Priced at the roofline's norm
    /// bandwidth, below a streaming kernel's (`Roofline::norm_share`).
    Norm,
    /// Everything else: activations, eager attention's pieces, the loss,
    /// copies, the optimizer update, collectives' local work.
    Stream,
}

/// One kernel call's cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    pub name: &'static str,
    pub flops: u64,
    pub bytes: u64,
    pub kind: Kind,
}

impl Work {
    /// A streaming kernel (or a copy): `flops` of arithmetic over `bytes`.
    pub fn stream(name: &'static str, flops: impl TryInto<u64>, bytes: u64) -> Work {
        Work {
            name,
            flops: flops.try_into().unwrap_or(u64::MAX),
            bytes,
            kind: Kind::Stream,
        }
    }

    /// A normalization kernel (`Kind::Norm`): `flops` over `bytes`.
    pub fn norm(name: &'static str, flops: impl TryInto<u64>, bytes: u64) -> Work {
        Work {
            kind: Kind::Norm,
            ..Work::stream(name, flops, bytes)
        }
    }

    /// One or two GEMMs plus `extra` streaming FLOPs.
    pub fn gemm(name: &'static str, gemms: [Option<Gemm>; 2], extra: u64, bytes: u64) -> Work {
        let flops = gemms.iter().flatten().map(Gemm::flops).sum::<u64>() + extra;
        Work {
            name,
            flops,
            bytes,
            kind: Kind::Gemm(gemms),
        }
    }

    /// A linear layer's forward: `out[n×oc] = inp[n×c] · w[c×oc] (+ bias)`.
    pub fn matmul(n: usize, c: usize, oc: usize, bytes: u64) -> Work {
        Work::gemm("matmul", [Some(Gemm::new(n, oc, c)), None], 0, bytes)
    }

    /// Its backward: `dinp = dout · wᵀ` always, `dw = inpᵀ · dout` (and the
    /// bias's column sums) when the weight trains.
    pub fn matmul_backward(
        n: usize,
        c: usize,
        oc: usize,
        trained: bool,
        bias: bool,
        bytes: u64,
    ) -> Work {
        let dinp = Gemm::new(n, c, oc);
        let dw = trained.then(|| Gemm::new(c, oc, n));
        let extra = (bias && trained) as u64 * (n * oc) as u64;
        Work::gemm("matmul_backward", [Some(dinp), dw], extra, bytes)
    }

    /// The experts' grouped GEMM over `m` routed rows in `experts` groups,
    /// priced as `experts` GEMMs of the mean group's rows.
    pub fn grouped(
        name: &'static str,
        (m, experts): (usize, usize),
        c: usize,
        oc: usize,
        passes: usize,
        bytes: u64,
    ) -> Work {
        let e = experts.max(1);
        let g = Gemm {
            m: m.div_ceil(e),
            n: oc,
            k: c,
            count: e,
        };
        let mut w = Work::gemm(name, [Some(g), (passes > 1).then_some(g)], 0, bytes);
        // Exact FLOPs, not the rounded-up mean's.
        w.flops = (passes * 2 * m * c * oc) as u64;
        w
    }

    /// Causal pairs (`t2 <= t`) times heads times batch: what the
    /// attention kernels compute.
    pub fn causal_pairs(s: AttnShape) -> u64 {
        (s.b * s.n_head * s.t * (s.t + 1) / 2) as u64
    }

    /// Eager attention's forward: scores `q·k`, softmax (about 5 FLOPs an
    /// entry), `att·v`.
    pub fn attention(s: AttnShape, bytes: u64) -> Work {
        let flops = Self::causal_pairs(s) * (4 * s.head_dim as u64 + 5);
        Work::stream("attention", flops, bytes)
    }

    /// Its backward: `datt = dout·v`, `dv += att·dout`, the softmax's
    /// backward, `dq` and `dk`.
    pub fn attention_backward(s: AttnShape, bytes: u64) -> Work {
        let flops = Self::causal_pairs(s) * (8 * s.head_dim as u64 + 4);
        Work::stream("attention_backward", flops, bytes)
    }

    /// Flash attention's forward: eager's arithmetic plus the online
    /// softmax's rescaling.
    pub fn flash_attention(s: AttnShape, bytes: u64) -> Work {
        Work {
            name: "flash_attention",
            flops: Self::causal_pairs(s) * (4 * s.head_dim as u64 + 7),
            bytes,
            kind: Kind::FusedAttention {
                t: s.t,
                head_dim: s.head_dim,
            },
        }
    }

    /// Its backward, which recomputes the scores (2·head_dim a pair) on top
    /// of eager's backward.
    pub fn flash_attention_backward(s: AttnShape, bytes: u64) -> Work {
        Work {
            name: "flash_attention_backward",
            flops: Self::causal_pairs(s) * (10 * s.head_dim as u64 + 6),
            bytes,
            kind: Kind::FusedAttention {
                t: s.t,
                head_dim: s.head_dim,
            },
        }
    }

    /// RoPE on the q and k heads: 6 FLOPs per rotated pair (4 multiplies,
    /// 2 adds) plus the sin and cos.
    pub fn rope(name: &'static str, s: AttnShape, bytes: u64) -> Work {
        let flops = (s.b * s.t * (s.n_head + s.n_kv_head) * s.head_dim / 2 * 6) as u64;
        Work::stream(name, flops, bytes)
    }

    /// The FLOPs of this call's GEMMs.
    pub fn gemm_flops(&self) -> u64 {
        match self.kind {
            Kind::Gemm(g) => g.iter().flatten().map(Gemm::flops).sum(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_linear_layers_backward_is_two_gemms_of_the_forwards_flops() {
        let f = Work::matmul(64, 32, 96, 0);
        assert_eq!(f.flops, 2 * 64 * 32 * 96);
        let b = Work::matmul_backward(64, 32, 96, true, true, 0);
        assert_eq!(b.flops, 2 * f.flops + 64 * 96);
        assert_eq!(b.gemm_flops(), 2 * f.flops);
        let frozen = Work::matmul_backward(64, 32, 96, false, true, 0);
        assert_eq!(frozen.flops, f.flops, "a frozen weight: dinp only");
    }

    #[test]
    fn a_grouped_gemm_counts_its_exact_rows() {
        let w = Work::grouped("grouped_matmul", (10, 4), 8, 16, 1, 0);
        assert_eq!(w.flops, 2 * 10 * 8 * 16);
        let Kind::Gemm([Some(g), None]) = w.kind else {
            panic!("{:?}", w.kind)
        };
        assert_eq!((g.m, g.count), (3, 4));
    }
}
