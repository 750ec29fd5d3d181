//! Attention on the GPU: eager (the T x T probabilities stored, as the engine
//! asks) and flash-style (`kernels/attention.cu`).
//!
//! Eager: the products are strided-batched GEMMs (cuBLAS, tensor cores on a
//! GPU) straight on the packed `qkv (B,T,(H+2*KVH)*hd)` layout: inside one
//! sequence, query head `h` is the `(T,hd)` matrix at column `h*hd` with row
//! stride `qkv_width`, so a batch of heads is a fixed element stride apart
//! (no permuted copies, no scratch: the eager ops get no workspace). One call
//! per sequence and head set ([`head_sets`]). The scores GEMM writes
//! `scale * Q K^T` into `att`, a row-softmax kernel turns them into
//! probabilities in place (masked half exactly 0), and `out_h = P_h V`. The
//! backward writes `dP = dO V^T` into `datt`, `dV (+)= P^T dO`, turns `datt`
//! into `dS` in place, then `dQ = scale * dS K` and `dK (+)= scale * dS^T Q`.
//! When several query heads share a kv head (grouped-query attention), dK and
//! dV are sums over the group: the first head's GEMM overwrites (beta 0), the
//! others add (beta 1), in head order.
//!
//! Precision: products accumulate in fp32 and round once into their output's
//! type, as the cpu does. With 16-bit activations the scores, probabilities,
//! dP and dS pass through the 16-bit `att`/`datt` buffers between the GEMMs and
//! the softmax kernels (as in PyTorch's eager attention), and GQA's dK/dV sums
//! are rounded after each head, where the cpu keeps all of it in fp32 until
//! the end; the 16-bit eager checks allow for that.
//!
//! Flash: CUDA-core kernels (fp32 tiles in shared memory) described in the
//! .cu file; the forward needs no scratch, the backward one `f32` per query
//! row and head (`D = rowsum(dO * O)`), see [`workspace_bytes`]. Deterministic:
//! every output element is summed in a fixed order by one thread.

use super::check::{FLOATS, Harness, Tol, down, up};
use super::driver::{Arg, DevPtr, Driver, Gemm, LaunchCfg, MAX_STRIDE_BLOCKS};
use super::{CudaBackend, CudaBuf, n64};
use crate::backend::{AttnShape, Backend, DType};
use crate::both;

/// Largest head_dim the flash kernels take (their shared tiles' width,
/// `ATTN_MAXD` in the .cu file).
pub const FLASH_MAX_HEAD_DIM: usize = 128;
/// Query rows (= keys) per tile of the flash forward (`ATTN_FT`).
const FWD_TILE: usize = 32;
/// Query rows (= keys) per tile of the flash backward (`ATTN_BT`).
const BWD_TILE: usize = 16;
/// Threads per block of the flash kernels (16 row groups of 8).
const FLASH_THREADS: u32 = 128;
/// Warps per block of the one-warp-a-row kernels.
const ROW_WARPS: usize = 8;

/// Bytes of scratch the cuda attention needs for shape `s`: none for eager
/// attention (the ops get no workspace), and for flash attention the
/// backward's `D = rowsum(dO * O)`, one `f32` per head and query row:
/// `4 * B * n_head * T`, whatever the activations' type.
pub fn workspace_bytes(s: AttnShape, fused: bool, _dtype: DType) -> usize {
    if fused { 4 * s.b * s.n_head * s.t } else { 0 }
}

/// Query heads per kv head; panics on a shape no kernel can run.
fn group_size(s: AttnShape) -> usize {
    assert!(
        s.n_kv_head > 0 && s.n_head.is_multiple_of(s.n_kv_head),
        "n_head {} is not a multiple of n_kv_head {}",
        s.n_head,
        s.n_kv_head
    );
    s.n_head / s.n_kv_head
}

/// Heads one strided-batched GEMM covers inside a sequence: query heads
/// `h0 + i*dh` with kv heads `g0 + i*dg`, for `i < batch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Heads {
    h0: usize,
    dh: usize,
    g0: usize,
    dg: usize,
    batch: usize,
}

/// The head sets of shape `s`. With `distinct_kv` (the accumulating dK and dV
/// products) no two heads of a set share a kv head, and set `r` holds the
/// `r`-th head of every group, so set 0 overwrites and the rest add; otherwise
/// the fewest sets (all heads at once for multi-head attention).
fn head_sets(s: AttnShape, distinct_kv: bool) -> Vec<Heads> {
    let (nh, nkv) = (s.n_head, s.n_kv_head);
    let rep = nh / nkv;
    if rep == 1 {
        return vec![Heads {
            h0: 0,
            dh: 1,
            g0: 0,
            dg: 1,
            batch: nh,
        }];
    }
    if distinct_kv || rep <= nkv {
        (0..rep)
            .map(|r| Heads {
                h0: r,
                dh: rep,
                g0: 0,
                dg: 1,
                batch: nkv,
            })
            .collect()
    } else {
        (0..nkv)
            .map(|g| Heads {
                h0: g * rep,
                dh: 1,
                g0: g,
                dg: 0,
                batch: rep,
            })
            .collect()
    }
}

/// One GEMM operand: a matrix of `buf` at element `off`, column-major with
/// leading dimension `ld`, the next batch entry `stride` elements on.
struct Mat<'a> {
    buf: &'a CudaBuf,
    off: usize,
    ld: usize,
    stride: usize,
    trans: bool,
}

impl Mat<'_> {
    fn ptr(&self) -> DevPtr {
        self.buf.ptr + (self.off * self.buf.dtype.size()) as u64
    }
}

/// `C_i = alpha * op(A_i) op(B_i) + beta * C_i`, column-major, `i < batch`.
fn batched<D: Driver>(
    be: &mut CudaBackend<D>,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: Mat,
    b: Mat,
    beta: f32,
    c: Mat,
    batch: usize,
) {
    assert_eq!(
        a.buf.dtype, b.buf.dtype,
        "eager attention: GEMM operands of different types ({:?}, {:?})",
        a.buf.dtype, b.buf.dtype
    );
    be.drv.gemm(&Gemm {
        transa: a.trans,
        transb: b.trans,
        m,
        n,
        k,
        alpha,
        a: a.ptr(),
        lda: a.ld,
        stride_a: a.stride as i64,
        b: b.ptr(),
        ldb: b.ld,
        stride_b: b.stride as i64,
        ab_type: a.buf.dtype,
        beta,
        c: c.ptr(),
        ldc: c.ld,
        stride_c: c.stride as i64,
        c_type: c.buf.dtype,
        batch,
    });
}

/// A grid-stride launch of a one-warp-a-row kernel over `rows` rows.
fn row_cfg(rows: usize) -> LaunchCfg {
    let blocks = rows
        .div_ceil(ROW_WARPS)
        .clamp(1, MAX_STRIDE_BLOCKS as usize);
    LaunchCfg::linear(blocks as u32, (ROW_WARPS * 32) as u32)
}

fn check_len(what: &str, buf: &CudaBuf, need: usize) {
    assert!(
        buf.len >= need,
        "attention: {what} holds {} elements, the shape needs {need}",
        buf.len
    );
}

/// Where one head set's matrices sit in sequence `bi` of the eager
/// attention's buffers: q, k and v columns of a `(B,T,qkv_width)` buffer,
/// a head's columns of a `(B,T,H*hd)` one, and its `(T,T)` scores.
#[derive(Clone, Copy)]
struct Layout {
    t: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    /// qkv_width, out_width and T*T.
    w: usize,
    ow: usize,
    tt: usize,
}

impl Layout {
    fn new(s: AttnShape) -> Self {
        Layout {
            t: s.t,
            nh: s.n_head,
            nkv: s.n_kv_head,
            hd: s.head_dim,
            w: s.qkv_width(),
            ow: s.out_width(),
            tt: s.t * s.t,
        }
    }

    /// Columns `col` on of sequence `bi` in a qkv-shaped buffer.
    fn qkv_at<'a>(
        &self,
        buf: &'a CudaBuf,
        bi: usize,
        col: usize,
        stride: usize,
        trans: bool,
    ) -> Mat<'a> {
        Mat {
            buf,
            off: bi * self.t * self.w + col,
            ld: self.w,
            stride: stride * self.hd,
            trans,
        }
    }

    /// `Q_h`.
    fn q<'a>(&self, buf: &'a CudaBuf, bi: usize, hs: &Heads, trans: bool) -> Mat<'a> {
        self.qkv_at(buf, bi, hs.h0 * self.hd, hs.dh, trans)
    }

    /// `K_g`.
    fn k<'a>(&self, buf: &'a CudaBuf, bi: usize, hs: &Heads, trans: bool) -> Mat<'a> {
        self.qkv_at(buf, bi, (self.nh + hs.g0) * self.hd, hs.dg, trans)
    }

    /// `V_g`.
    fn v<'a>(&self, buf: &'a CudaBuf, bi: usize, hs: &Heads, trans: bool) -> Mat<'a> {
        self.qkv_at(
            buf,
            bi,
            (self.nh + self.nkv + hs.g0) * self.hd,
            hs.dg,
            trans,
        )
    }

    /// `O_h` in a `(B,T,H*hd)` buffer.
    fn out<'a>(&self, buf: &'a CudaBuf, bi: usize, hs: &Heads) -> Mat<'a> {
        Mat {
            buf,
            off: bi * self.t * self.ow + hs.h0 * self.hd,
            ld: self.ow,
            stride: hs.dh * self.hd,
            trans: false,
        }
    }

    /// Head `h`'s `(T,T)` scores in a `(B,H,T,T)` buffer.
    fn scores<'a>(&self, buf: &'a CudaBuf, bi: usize, hs: &Heads, trans: bool) -> Mat<'a> {
        Mat {
            buf,
            off: (bi * self.nh + hs.h0) * self.tt,
            ld: self.t,
            stride: hs.dh * self.tt,
            trans,
        }
    }
}

/// `out (B,T,H*hd)` and the probabilities `att (B,H,T,T)` (masked half 0)
/// from `qkv (B,T,qkv_width)`. `qkv` and `att` must have one type (the GEMM's
/// operands); `out` may have any float type.
pub(crate) fn eager_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    att: &mut CudaBuf,
    qkv: &CudaBuf,
    s: AttnShape,
) {
    let AttnShape {
        b,
        t,
        n_head: nh,
        head_dim: hd,
        ..
    } = s;
    if b == 0 || t == 0 || nh == 0 {
        return;
    }
    group_size(s);
    let l = Layout::new(s);
    check_len("qkv", qkv, b * t * l.w);
    check_len("out", out, b * t * l.ow);
    check_len("att", att, b * nh * l.tt);
    let scale = 1.0 / (hd as f32).sqrt();
    let sets = head_sets(s, false);
    for bi in 0..b {
        for hs in &sets {
            // att_h (T,T) = scale * Q_h K_g^T, issued as att_h^T = K_g Q_h^T.
            let (k, q) = (l.k(qkv, bi, hs, true), l.q(qkv, bi, hs, false));
            batched(
                be,
                (t, t, hd),
                scale,
                k,
                q,
                0.0,
                l.scores(att, bi, hs, false),
                hs.batch,
            );
        }
    }
    let rows = b * nh * t;
    be.launch(
        "attn_softmax_forward_kernel",
        row_cfg(rows),
        &[att.arg(), att.dt(), n64(rows), Arg::I32(t as i32)],
    );
    for bi in 0..b {
        for hs in &sets {
            // out_h (T,hd) = P_h V_g, issued as out_h^T = V_g^T P_h^T. The
            // masked probabilities are exact zeros, so the full-width product
            // is the causal sum.
            let (v, p) = (l.v(qkv, bi, hs, false), l.scores(att, bi, hs, false));
            batched(be, (hd, t, t), 1.0, v, p, 0.0, l.out(out, bi, hs), hs.batch);
        }
    }
}

/// `dqkv (B,T,qkv_width)` (overwritten) from `dout (B,T,H*hd)`, `qkv` and the
/// saved probabilities `att`; `datt (B,H,T,T)` is scratch (left holding dS).
/// `dout`, `qkv`, `att` and `datt` must have one type.
pub(crate) fn eager_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dqkv: &mut CudaBuf,
    datt: &mut CudaBuf,
    dout: &CudaBuf,
    qkv: &CudaBuf,
    att: &CudaBuf,
    s: AttnShape,
) {
    let AttnShape {
        b,
        t,
        n_head: nh,
        head_dim: hd,
        ..
    } = s;
    if b == 0 || t == 0 || nh == 0 {
        return;
    }
    group_size(s);
    let l = Layout::new(s);
    check_len("qkv", qkv, b * t * l.w);
    check_len("dqkv", dqkv, b * t * l.w);
    check_len("dout", dout, b * t * l.ow);
    check_len("att", att, b * nh * l.tt);
    check_len("datt", datt, b * nh * l.tt);
    let scale = 1.0 / (hd as f32).sqrt();
    let (sets, ranks) = (head_sets(s, false), head_sets(s, true));
    // Set 0 of the distinct-kv sets overwrites, the rest add.
    let accumulate = |r: usize| if r == 0 { 0.0 } else { 1.0 };
    for bi in 0..b {
        for hs in &sets {
            // dP_h (T,T) = dO_h V_g^T, issued as dP_h^T = V_g dO_h^T.
            let (v, d_o) = (l.v(qkv, bi, hs, true), l.out(dout, bi, hs));
            batched(
                be,
                (t, t, hd),
                1.0,
                v,
                d_o,
                0.0,
                l.scores(datt, bi, hs, false),
                hs.batch,
            );
        }
        for (r, hs) in ranks.iter().enumerate() {
            // dV_g (T,hd) (+)= P_h^T dO_h, issued as dV_g^T = dO_h^T P_h.
            let (d_o, p) = (l.out(dout, bi, hs), l.scores(att, bi, hs, true));
            let dv = l.v(dqkv, bi, hs, false);
            batched(be, (hd, t, t), 1.0, d_o, p, accumulate(r), dv, hs.batch);
        }
    }
    let rows = b * nh * t;
    be.launch(
        "attn_softmax_backward_kernel",
        row_cfg(rows),
        &[
            datt.arg(),
            datt.dt(),
            att.arg(),
            att.dt(),
            n64(rows),
            Arg::I32(t as i32),
        ],
    );
    for bi in 0..b {
        for hs in &sets {
            // dQ_h (T,hd) = scale * dS_h K_g, issued as dQ_h^T = K_g^T dS_h^T.
            let (k, ds) = (l.k(qkv, bi, hs, false), l.scores(datt, bi, hs, false));
            batched(
                be,
                (hd, t, t),
                scale,
                k,
                ds,
                0.0,
                l.q(dqkv, bi, hs, false),
                hs.batch,
            );
        }
        for (r, hs) in ranks.iter().enumerate() {
            // dK_g (T,hd) (+)= scale * dS_h^T Q_h, issued as dK_g^T = Q_h^T dS_h.
            let (q, ds) = (l.q(qkv, bi, hs, false), l.scores(datt, bi, hs, true));
            let dk = l.k(dqkv, bi, hs, false);
            batched(be, (hd, t, t), scale, q, ds, accumulate(r), dk, hs.batch);
        }
    }
}

/// The checks and grid dimensions shared by the flash kernels.
fn flash_shape(s: AttnShape) -> (u32, u32, u32) {
    group_size(s);
    assert!(
        s.head_dim > 0 && s.head_dim <= FLASH_MAX_HEAD_DIM,
        "flash attention on cuda takes head_dim 1..={FLASH_MAX_HEAD_DIM}, not {}",
        s.head_dim
    );
    assert!(
        s.n_head <= 65535 && s.b <= 65535 && s.t <= i32::MAX as usize,
        "attention shape {s:?} exceeds the launch grid"
    );
    (s.t as u32, s.n_head as u32, s.b as u32)
}

fn flash_cfg(tiles: usize, heads: u32, b: u32) -> LaunchCfg {
    LaunchCfg {
        grid: [tiles as u32, heads, b],
        block: [FLASH_THREADS, 1, 1],
        shared_bytes: 0,
    }
}

/// `out (B,T,H*hd)` and `lse (B,H,T)` from `qkv`; needs no workspace.
pub(crate) fn flash_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    lse: &mut CudaBuf,
    qkv: &CudaBuf,
    _ws: &mut CudaBuf,
    s: AttnShape,
) {
    if s.b == 0 || s.t == 0 || s.n_head == 0 {
        return;
    }
    let (t, nh, b) = flash_shape(s);
    check_len("qkv", qkv, s.b * s.t * s.qkv_width());
    check_len("out", out, s.b * s.t * s.out_width());
    check_len("lse", lse, s.b * s.n_head * s.t);
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    be.launch(
        "attn_flash_forward_kernel",
        flash_cfg(s.t.div_ceil(FWD_TILE), nh, b),
        &[
            out.arg(),
            out.dt(),
            lse.arg(),
            lse.dt(),
            qkv.arg(),
            qkv.dt(),
            Arg::I32(t as i32),
            Arg::I32(nh as i32),
            Arg::I32(s.n_kv_head as i32),
            Arg::I32(s.head_dim as i32),
            Arg::F32(scale),
        ],
    );
}

/// `dqkv` (overwritten) from `dout`, the forward's `out` and `lse`, and `qkv`;
/// `ws` (an `f32` buffer of [`workspace_bytes`]) receives `D`.
pub(crate) fn flash_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dqkv: &mut CudaBuf,
    dout: &CudaBuf,
    out: &CudaBuf,
    lse: &CudaBuf,
    qkv: &CudaBuf,
    ws: &mut CudaBuf,
    s: AttnShape,
) {
    if s.b == 0 || s.t == 0 || s.n_head == 0 {
        return;
    }
    let (t, nh, b) = flash_shape(s);
    let rows = s.b * s.n_head * s.t;
    check_len("qkv", qkv, s.b * s.t * s.qkv_width());
    check_len("dqkv", dqkv, s.b * s.t * s.qkv_width());
    check_len("out", out, s.b * s.t * s.out_width());
    check_len("dout", dout, s.b * s.t * s.out_width());
    check_len("lse", lse, rows);
    assert!(
        ws.dtype == DType::F32 && ws.len * 4 >= workspace_bytes(s, true, qkv.dtype),
        "flash attention backward: the workspace is {} {:?}, it needs {} bytes of f32",
        ws.len,
        ws.dtype,
        workspace_bytes(s, true, qkv.dtype)
    );
    let hd = s.head_dim as i32;
    be.launch(
        "attn_flash_rowdot_kernel",
        row_cfg(rows),
        &[
            ws.arg(),
            dout.arg(),
            dout.dt(),
            out.arg(),
            out.dt(),
            n64(rows),
            Arg::I32(t as i32),
            Arg::I32(nh as i32),
            Arg::I32(hd),
        ],
    );
    let args = [
        dqkv.arg(),
        dqkv.dt(),
        dout.arg(),
        dout.dt(),
        lse.arg(),
        lse.dt(),
        ws.arg(),
        qkv.arg(),
        qkv.dt(),
        Arg::I32(t as i32),
        Arg::I32(nh as i32),
        Arg::I32(s.n_kv_head as i32),
        Arg::I32(hd),
        Arg::F32(1.0 / (s.head_dim as f32).sqrt()),
    ];
    let tiles = s.t.div_ceil(BWD_TILE);
    be.launch(
        "attn_flash_backward_dkv_kernel",
        flash_cfg(tiles, s.n_kv_head as u32, b),
        &args,
    );
    be.launch(
        "attn_flash_backward_dq_kernel",
        flash_cfg(tiles, nh, b),
        &args,
    );
}

// ----------------------------------------------------------------------------
// Checks against the cpu backend

fn shape(b: usize, t: usize, n_head: usize, n_kv_head: usize, head_dim: usize) -> AttnShape {
    AttnShape {
        b,
        t,
        n_head,
        n_kv_head,
        head_dim,
    }
}

fn describe(s: AttnShape) -> String {
    format!(
        "b={} t={} h={}/{} hd={}",
        s.b, s.t, s.n_head, s.n_kv_head, s.head_dim
    )
}

/// A buffer of NaNs: every output must be overwritten, no scratch read unwritten.
fn nans<B: Backend>(be: &mut B, n: usize, dt: DType) -> B::Buf {
    up(be, &vec![f32::NAN; n], dt)
}

/// Eager forward: `[out, att]`.
fn eager_fwd<B: Backend>(be: &mut B, qkv: &[f32], s: AttnShape, dt: DType) -> Vec<Vec<f32>> {
    let (on, an) = (s.b * s.t * s.out_width(), s.b * s.n_head * s.t * s.t);
    let x = up(be, qkv, dt);
    let (mut out, mut att) = (nans(be, on, dt), nans(be, an, dt));
    be.attention_forward(&mut out, &mut att, &x, s);
    vec![down(be, &out), down(be, &att)]
}

/// Eager backward from given probabilities: `[dqkv]`.
fn eager_bwd<B: Backend>(
    be: &mut B,
    qkv: &[f32],
    dout: &[f32],
    att: &[f32],
    s: AttnShape,
    dt: DType,
) -> Vec<Vec<f32>> {
    let (x, dy, a) = (up(be, qkv, dt), up(be, dout, dt), up(be, att, dt));
    let mut dqkv = nans(be, qkv.len(), dt);
    let mut datt = nans(be, att.len(), dt);
    be.attention_backward(&mut dqkv, &mut datt, &dy, &x, &a, s);
    vec![down(be, &dqkv)]
}

/// Flash forward on the backend's own workspace: `[out, lse]`.
fn flash_fwd<B: Backend>(be: &mut B, qkv: &[f32], s: AttnShape, dt: DType) -> Vec<Vec<f32>> {
    let mut ws = nans(be, be.workspace_bytes(s, true, dt).div_ceil(4), DType::F32);
    let x = up(be, qkv, dt);
    let mut out = nans(be, s.b * s.t * s.out_width(), dt);
    let mut lse = nans(be, s.b * s.n_head * s.t, DType::F32);
    be.flash_attention_forward(&mut out, &mut lse, &x, &mut ws, s);
    vec![down(be, &out), down(be, &lse)]
}

/// Flash backward from a given forward's `out` and `lse`: `[dqkv]`.
fn flash_bwd<B: Backend>(
    be: &mut B,
    qkv: &[f32],
    dout: &[f32],
    (out, lse): (&[f32], &[f32]),
    s: AttnShape,
    dt: DType,
) -> Vec<Vec<f32>> {
    let mut ws = nans(be, be.workspace_bytes(s, true, dt).div_ceil(4), DType::F32);
    let (x, dy, o) = (up(be, qkv, dt), up(be, dout, dt), up(be, out, dt));
    let l = up(be, lse, DType::F32);
    let mut dqkv = nans(be, qkv.len(), dt);
    be.flash_attention_backward(&mut dqkv, &dy, &o, &l, &x, &mut ws, s);
    vec![down(be, &dqkv)]
}

/// Cases for `memfit selftest` and `cargo test` (see `check.rs`): eager and
/// flash, forward and backward, in every float type, on a single token, odd
/// T, T past several tiles (forward 32, backward 16), grouped-query (2 and 4
/// heads a kv head) and multi-head attention, head_dim 16, 64 and 128. Each
/// backward starts from the cpu forward's results on both backends, so a
/// 16-bit output that rounds to a neighbouring value in one forward is not
/// carried into the backward comparison.
pub(crate) fn check_cases<D: Driver>(h: &mut Harness<D>) {
    let shapes = [
        shape(1, 1, 2, 1, 16),
        shape(2, 37, 4, 2, 16),
        shape(1, 70, 2, 2, 64),
        shape(1, 33, 4, 1, 128),
    ];
    // fp32: the same sums in another order (GEMM vs the cpu's loops, tiles
    // vs rows), a few ulps of the largest terms.
    let tol = Tol::new(2e-5, 2e-5);
    for &dt in &FLOATS {
        // 16-bit eager: the GPU rounds scores, probabilities, dP and dS to the
        // activation type between its GEMMs and softmax kernels (and a GQA
        // group's dK/dV after each head) where the cpu stays in fp32, so the
        // error is a few units in the last place of the terms, not of the result.
        let eager_tol = match dt {
            DType::Bf16 => Tol::new(2e-2, 4e-2),
            DType::F16 => Tol::new(3e-3, 6e-3),
            _ => tol,
        };
        for s in shapes {
            let qkv = h.randn(s.b * s.t * s.qkv_width(), 1.0);
            let dout = h.randn(s.b * s.t * s.out_width(), 1.0);
            let (c, g) = both!(h, eager_fwd(&qkv, s, dt));
            let names = ["out", "att"];
            h.compare(
                "attention eager fwd",
                describe(s),
                dt,
                &names,
                &c,
                &g,
                eager_tol,
            );
            let att = &c[1];
            let (c, g) = both!(h, eager_bwd(&qkv, &dout, att, s, dt));
            h.compare(
                "attention eager bwd",
                describe(s),
                dt,
                &["dqkv"],
                &c,
                &g,
                eager_tol,
            );
            let (c, g) = both!(h, flash_fwd(&qkv, s, dt));
            h.compare(
                "attention flash fwd",
                describe(s),
                dt,
                &["out", "lse"],
                &c,
                &g,
                tol,
            );
            let fwd = (c[0].as_slice(), c[1].as_slice());
            let (c, g) = both!(h, flash_bwd(&qkv, &dout, fwd, s, dt));
            h.compare(
                "attention flash bwd",
                describe(s),
                dt,
                &["dqkv"],
                &c,
                &g,
                tol,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::check::{table, tests::assert_all_pass, tests::harness};

    #[test]
    fn attention_matches_cpu_on_the_emulated_gpu() {
        let mut h = harness(4);
        check_cases(&mut h);
        println!("{}", table(&h.rows));
        assert_all_pass(&h);
    }

    #[test]
    fn flash_is_bit_identical_run_to_run() {
        let mut h = harness(5);
        let s = shape(2, 45, 4, 2, 32);
        let qkv = h.randn(s.b * s.t * s.qkv_width(), 1.0);
        let dout = h.randn(s.b * s.t * s.out_width(), 1.0);
        let bits = |v: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
            v.iter()
                .map(|x| x.iter().map(|f| f.to_bits()).collect())
                .collect()
        };
        let run = |h: &mut Harness<_>| {
            let fwd = flash_fwd(&mut h.gpu, &qkv, s, DType::F32);
            let bwd = flash_bwd(&mut h.gpu, &qkv, &dout, (&fwd[0], &fwd[1]), s, DType::F32);
            bits(fwd.into_iter().chain(bwd).collect())
        };
        let (one, two) = (run(&mut h), run(&mut h));
        assert!(one == two, "flash attention is not deterministic");
    }

    #[test]
    fn workspace_is_d_for_flash_and_nothing_for_eager() {
        for dt in FLOATS {
            let s = shape(3, 70, 12, 4, 64);
            assert_eq!(workspace_bytes(s, false, dt), 0);
            assert_eq!(workspace_bytes(s, true, dt), 4 * 3 * 12 * 70);
            assert_eq!(workspace_bytes(shape(0, 70, 12, 4, 64), true, dt), 0);
            assert_eq!(workspace_bytes(shape(2, 1, 1, 1, 8), true, dt), 8);
        }
    }

    #[test]
    fn head_sets_cover_every_head_once_with_its_kv_head() {
        for (nh, nkv) in [(4, 4), (4, 2), (8, 2), (6, 3), (4, 1), (1, 1)] {
            let s = shape(1, 4, nh, nkv, 8);
            for distinct in [false, true] {
                let mut seen = vec![0; nh];
                for hs in head_sets(s, distinct) {
                    let mut kv = Vec::new();
                    for i in 0..hs.batch {
                        let (h, g) = (hs.h0 + i * hs.dh, hs.g0 + i * hs.dg);
                        assert_eq!(g, h / (nh / nkv), "{nh}/{nkv}: head {h}");
                        seen[h] += 1;
                        kv.push(g);
                    }
                    if distinct {
                        kv.dedup();
                        assert_eq!(kv.len(), hs.batch, "{nh}/{nkv}: a kv head twice in a set");
                    }
                }
                assert!(seen.iter().all(|&n| n == 1), "{nh}/{nkv}: {seen:?}");
            }
        }
    }
}
