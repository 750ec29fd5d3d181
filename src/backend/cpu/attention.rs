//! Fused (flash-style) causal attention for the cpu backend.
//!
//! FlashAttention (Dao et al., 2022) computes `softmax(Q K^T * scale) V` without
//! materialising the T x T probabilities: keys and values stream through in
//! tiles of [`BC`] keys, and each block of [`BR`] query rows keeps a running max
//! `m`, a running sum `l` and an unnormalised output accumulator, rescaling both
//! by `exp(m_old - m_new)` whenever the max grows (the online softmax). The
//! forward saves only `lse = m + ln(l)` per row.
//!
//! The backward follows FlashAttention-2 (Dao, 2023): it recomputes each
//! probability tile as `P = exp(S - lse)`, replaces the softmax backward's
//! `rowsum(P * dP)` by the equal `D = rowsum(dO * O)` (cheap, one dot per row),
//! and accumulates dQ, dK and dV tile by tile.
//!
//! Memory: the only scratch is [`SLOTS`] fixed slots of tile buffers (see
//! [`workspace_bytes`]), none of them T-sized: the workspace is constant in T
//! once T reaches `BR * SLOTS`, and below that it only shrinks.
//!
//! Parallelism and determinism: the work is cut into at most [`SLOTS`] groups,
//! a number that depends on the shape only, never on the pool size. Group `gi`
//! owns slot `gi` of the workspace and runs its tasks (round robin over the task
//! list) in a fixed order on one thread; every task writes output that no other
//! task writes, and fully initialises the scratch it reads. So every result is
//! bit-identical for any thread count (and even for any `SLOTS`).
//!
//! Tiles are small (64 x 64, head_dim 16..128), so the products are plain loops
//! written to auto-vectorise along the contiguous dimension (keys for scores,
//! head_dim for the accumulations), run under [`simd`]; no GEMM calls.

use rayon::prelude::*;

use super::elementwise::softcap;
use super::math::{dot, exp_f32, sum, vectorized};
use super::{CpuBackend, CpuBuf};
use crate::backend::{AttnOpts, AttnShape};

/// Query rows per block (FlashAttention's `Br`).
const BR: usize = 64;
/// Keys per tile (FlashAttention's `Bc`). Equal to [`BR`], so block `i`'s last
/// key tile is exactly its diagonal tile and every row sees a key in every tile.
const BC: usize = 64;
/// Scratch slots: the most groups of work that run at once.
const SLOTS: usize = 8;

// ----------------------------------------------------------------------------
// Tiling and workspace

/// The tiling of shape `s`, a pure function of the shape.
#[derive(Clone, Copy, Debug)]
struct Tiling {
    /// Query rows per block, `min(BR, T)`.
    br: usize,
    /// Keys per tile, `min(BC, T)`.
    bc: usize,
    /// Query blocks per sequence, `ceil(T / br)`.
    nqb: usize,
    /// Slots in use: `min(SLOTS, B*H*nqb)`, the forward's task count.
    slots: usize,
    /// f32 per slot.
    slot_len: usize,
}

impl Tiling {
    fn new(s: AttnShape) -> Self {
        let (br, bc) = (BR.min(s.t), BC.min(s.t));
        let nqb = s.t.div_ceil(br.max(1));
        let slots = SLOTS.min(s.b * s.n_head * nqb);
        let hd = s.head_dim;
        // s, dp tiles (br,bc); kt, vt (hd,bc); m|D, l|lse (br); acc (br,hd).
        let slot_len = 2 * br * bc + 2 * hd * bc + 2 * br + br * hd;
        Tiling {
            br,
            bc,
            nqb,
            slots,
            slot_len,
        }
    }
}

/// One slot's tile buffers. The forward leaves `dp` and `vt` unused; the
/// backward uses `m` for `D` and `l` for `lse`.
struct Slot<'a> {
    /// Scores, then probabilities `(br, bc)`, row stride `bc`.
    s: &'a mut [f32],
    /// `dP`, then `dS * scale` `(br, bc)`, row stride `bc`.
    dp: &'a mut [f32],
    /// The key tile transposed `(hd, nc)`, so score rows run along keys.
    kt: &'a mut [f32],
    /// The value tile transposed `(hd, nc)`.
    vt: &'a mut [f32],
    m: &'a mut [f32],
    l: &'a mut [f32],
    /// Output (forward) or dQ (backward) accumulator `(br, hd)`.
    acc: &'a mut [f32],
}

impl<'a> Slot<'a> {
    fn split(buf: &'a mut [f32], tl: Tiling, hd: usize) -> Self {
        let (br, bc) = (tl.br, tl.bc);
        let (s, rest) = buf.split_at_mut(br * bc);
        let (dp, rest) = rest.split_at_mut(br * bc);
        let (kt, rest) = rest.split_at_mut(hd * bc);
        let (vt, rest) = rest.split_at_mut(hd * bc);
        let (m, rest) = rest.split_at_mut(br);
        let (l, acc) = rest.split_at_mut(br);
        Slot {
            s,
            dp,
            kt,
            vt,
            m,
            l,
            acc,
        }
    }
}

/// Bytes of tile scratch the fused kernels need for shape `s`:
/// `4 * slots * (2*br*bc + 2*hd*bc + 2*br + br*hd)` with `br = min(BR, T)`,
/// `bc = min(BC, T)` and `slots = min(SLOTS, B*H*ceil(T/br))`. Independent of
/// the thread count, so the meta backend predicts it exactly; bounded in T
/// (constant from `T = BR*SLOTS` on, whatever B and H), never T x T.
pub fn workspace_bytes(s: AttnShape) -> usize {
    if s.b == 0 || s.t == 0 || s.n_head == 0 {
        return 0;
    }
    let tl = Tiling::new(s);
    4 * tl.slots * tl.slot_len
}

// ----------------------------------------------------------------------------
// Helpers

/// A raw pointer that rayon tasks may share, for outputs that tasks write in
/// disjoint strided pieces (head columns of `out`, `dqkv`) that `chunks_mut`
/// cannot express.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: every call site writes through it only regions owned by one task.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// `len` elements from offset `off`.
    ///
    /// # Safety
    /// `off + len` is in bounds of the buffer, and no other live reference
    /// (in this task or any other) overlaps the range.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice<'a>(&self, off: usize, len: usize) -> &'a mut [f32] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(off), len) }
    }

    /// The pointer `off` elements on (a method, so closures capture the whole
    /// `Sync` wrapper rather than its raw-pointer field).
    ///
    /// # Safety
    /// `off` is in bounds of the buffer.
    unsafe fn at(self, off: usize) -> SyncPtr {
        SyncPtr(unsafe { self.0.add(off) })
    }
}

/// `y += a * x`.
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `max(x)`, `-inf` for an empty slice.
#[inline(always)]
fn max(x: &[f32]) -> f32 {
    x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// Keys of tile `[c0, c0+nc)` that query row `r` attends to (causal: `<= r`).
#[inline(always)]
fn live_keys(r: usize, c0: usize, nc: usize) -> usize {
    (r + 1).saturating_sub(c0).min(nc)
}

/// The first key of tile `[c0, ..)` inside query row `r`'s window (keys
/// `r + 1 - window ..= r`), capped at `live`: keys before it are masked.
#[inline(always)]
fn window_start(r: usize, c0: usize, live: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| {
        (r + 1).saturating_sub(w).saturating_sub(c0).min(live)
    })
}

/// The first key tile any row of block `r0..` sees: tiles wholly before
/// the block's first window are skipped (a sliding window saves compute,
/// not memory).
#[inline(always)]
fn first_tile(r0: usize, bc: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (r0 + 1).saturating_sub(w) / bc * bc)
}

/// Copies the key or value tile `x[c0..c0+nc]` of one head into `xt (hd, nc)`,
/// transposed. `qkv (T, w)` is the sequence's rows, `col` the head's column.
#[inline(always)]
fn transpose_tile(xt: &mut [f32], qkv: &[f32], w: usize, col: usize, c0: usize, nc: usize) {
    let hd = xt.len() / nc;
    for j in 0..nc {
        let x = &qkv[(c0 + j) * w + col..][..hd];
        for (d, &v) in x.iter().enumerate() {
            xt[d * nc + j] = v;
        }
    }
}

/// `srow (live) = a * (x K^T)` for the first `live` keys of the tile held
/// transposed in `kt (hd, nc)`: hd axpys along the keys, which vectorise where
/// hd-long dot products would not.
#[inline(always)]
fn row_times_tile(srow: &mut [f32], x: &[f32], a: f32, kt: &[f32], nc: usize) {
    srow.fill(0.0);
    let live = srow.len();
    for (d, &xd) in x.iter().enumerate() {
        axpy(srow, a * xd, &kt[d * nc..][..live]);
    }
}

/// Checks the buffer lengths the raw-pointer writes rely on.
fn check_shape(s: AttnShape) -> usize {
    assert!(
        s.n_kv_head > 0 && s.n_head.is_multiple_of(s.n_kv_head),
        "n_head {} is not a multiple of n_kv_head {}",
        s.n_head,
        s.n_kv_head
    );
    assert!(s.head_dim > 0, "fused attention needs head_dim > 0");
    s.n_head / s.n_kv_head
}

// ----------------------------------------------------------------------------
// Forward

/// Fused causal attention forward.
///
/// out (B,T,H*hd), lse (B,H,T) written; qkv (B,T,qkv_width); ws the workspace.
///
/// Tasks are (b, h, query block), in that order, dealt round robin to the
/// groups; a task reads its rows of q, keys/values `0..r1` of kv head
/// `h / (H/KVH)`, and writes its rows of out (head h's columns) and of lse.
pub fn forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    lse: &mut CpuBuf,
    qkv: &CpuBuf,
    ws: &mut CpuBuf,
    s: AttnShape,
) {
    forward_with(be, out, lse, qkv, ws, s, AttnOpts::standard(s))
}

/// [`forward`] with Gemma's options: the scores' scale, their soft cap
/// (applied before the mask and the softmax, as FlashAttention-2's
/// `softcap`), and a sliding window.
pub fn forward_with(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    lse: &mut CpuBuf,
    qkv: &CpuBuf,
    ws: &mut CpuBuf,
    s: AttnShape,
    o: AttnOpts,
) {
    let AttnShape {
        b,
        t,
        n_head: nh,
        n_kv_head: _,
        head_dim: hd,
    } = s;
    if b == 0 || t == 0 || nh == 0 {
        return;
    }
    let rep = check_shape(s);
    let tl = Tiling::new(s);
    let (w, ow) = (s.qkv_width(), s.out_width());
    let qkv = &qkv.wide()[..b * t * w];
    let out = &mut out.wide_mut()[..b * t * ow];
    let lse = &mut lse.wide_mut()[..b * nh * t];
    let ws = &mut ws.wide_mut()[..tl.slots * tl.slot_len];
    let (out, lse) = (SyncPtr(out.as_mut_ptr()), SyncPtr(lse.as_mut_ptr()));
    let ntasks = b * nh * tl.nqb;
    be.pool.install(|| {
        ws.par_chunks_mut(tl.slot_len)
            .enumerate()
            .for_each(|(gi, buf)| {
                let mut sl = Slot::split(buf, tl, hd);
                for task in (gi..ntasks).step_by(tl.slots) {
                    let (bh, qb) = (task / tl.nqb, task % tl.nqb);
                    let (bi, h) = (bh / nh, bh % nh);
                    let seq = &qkv[bi * t * w..][..t * w];
                    let r0 = qb * tl.br;
                    let r1 = (r0 + tl.br).min(t);
                    vectorized(
                        #[inline(always)]
                        || forward_block(&mut sl, seq, s, tl, (h, h / rep), (r0, r1), o),
                    );
                    // SAFETY: rows r0..r1 of batch bi, head h's columns of out
                    // and head h's row of lse: in bounds (lengths sliced above),
                    // and only this task writes them.
                    for i in 0..r1 - r0 {
                        let o = unsafe { out.slice((bi * t + r0 + i) * ow + h * hd, hd) };
                        let inv = 1.0 / sl.l[i];
                        for (o, &a) in o.iter_mut().zip(&sl.acc[i * hd..][..hd]) {
                            *o = a * inv;
                        }
                    }
                    let l = unsafe { lse.slice((bi * nh + h) * t + r0, r1 - r0) };
                    for (i, l) in l.iter_mut().enumerate() {
                        *l = sl.m[i] + sl.l[i].ln();
                    }
                }
            })
    });
}

/// One query block `r0..r1` of query head `h` (kv head `g`) of one sequence
/// `seq (T, w)`: leaves in the slot the running max `m (nr)`, running sum
/// `l (nr)` and unnormalised output `acc (nr, hd)` after all its key tiles.
#[inline(always)]
fn forward_block(
    sl: &mut Slot,
    seq: &[f32],
    s: AttnShape,
    tl: Tiling,
    (h, g): (usize, usize),
    (r0, r1): (usize, usize),
    o: AttnOpts,
) {
    let (nh, nkv, hd, w, bc) = (s.n_head, s.n_kv_head, s.head_dim, s.qkv_width(), tl.bc);
    let nr = r1 - r0;
    let (kcol, vcol) = ((nh + g) * hd, (nh + nkv + g) * hd);
    sl.m[..nr].fill(f32::NEG_INFINITY);
    sl.l[..nr].fill(0.0);
    sl.acc[..nr * hd].fill(0.0);
    // Key tiles up to the block's last row; the causal mask is applied by
    // visiting only each row's live keys, so nothing is ever -inf but the
    // initial max.
    for c0 in (first_tile(r0, bc, o.window)..r1).step_by(bc) {
        let nc = bc.min(r1 - c0);
        let kt = &mut sl.kt[..hd * nc];
        transpose_tile(kt, seq, w, kcol, c0, nc);
        for i in 0..nr {
            let r = r0 + i;
            let live = live_keys(r, c0, nc);
            let lo = window_start(r, c0, live, o.window);
            if live == lo {
                continue;
            }
            let q = &seq[r * w + h * hd..][..hd];
            // S_i (live) = scale * q_i K^T, soft-capped
            let srow = &mut sl.s[i * bc..][..live];
            row_times_tile(srow, q, o.scale, kt, nc);
            if let Some(cap) = o.softcap {
                for x in srow[lo..].iter_mut() {
                    *x = softcap(*x, cap);
                }
            }
            // Online softmax: new max, rescale what was summed under the old
            // one; keys before the window weigh 0.
            let m_old = sl.m[i];
            let m_new = m_old.max(max(&srow[lo..]));
            for p in srow.iter_mut() {
                *p = exp_f32(*p - m_new);
            }
            srow[..lo].fill(0.0);
            let acc = &mut sl.acc[i * hd..][..hd];
            if m_old != f32::NEG_INFINITY {
                let corr = exp_f32(m_old - m_new);
                sl.l[i] *= corr;
                for a in acc.iter_mut() {
                    *a *= corr;
                }
            }
            sl.l[i] += sum(srow);
            sl.m[i] = m_new;
            // acc_i (hd) += P_i (live) @ V (live, hd)
            for (j, &p) in srow.iter().enumerate() {
                axpy(acc, p, &seq[(c0 + j) * w + vcol..][..hd]);
            }
        }
    }
}

// ----------------------------------------------------------------------------
// Backward

/// Fused causal attention backward (FlashAttention-2's recomputation).
///
/// dqkv (B,T,qkv_width) overwritten; dout, out (B,T,H*hd); lse (B,H,T);
/// qkv (B,T,qkv_width); ws the workspace.
///
/// Tasks are (b, kv head g), dealt round robin to the groups. A task owns the
/// dq columns of the query heads `g*rep..(g+1)*rep` and the dk, dv columns of
/// kv head g for all rows of sequence b, so the dK/dV sums over the heads that
/// share a kv head stay inside one task, in a fixed order: heads, then query
/// blocks, then key tiles.
pub fn backward(
    be: &mut CpuBackend,
    dqkv: &mut CpuBuf,
    dout: &CpuBuf,
    out: &CpuBuf,
    lse: &CpuBuf,
    qkv: &CpuBuf,
    ws: &mut CpuBuf,
    s: AttnShape,
) {
    backward_with(be, dqkv, dout, out, lse, qkv, ws, s, AttnOpts::standard(s))
}

/// [`backward`] with Gemma's options ([`forward_with`]): the soft cap's
/// derivative `1 - tanh²` from the recomputed scores, nothing saved.
pub fn backward_with(
    be: &mut CpuBackend,
    dqkv: &mut CpuBuf,
    dout: &CpuBuf,
    out: &CpuBuf,
    lse: &CpuBuf,
    qkv: &CpuBuf,
    ws: &mut CpuBuf,
    s: AttnShape,
    o: AttnOpts,
) {
    let AttnShape {
        b,
        t,
        n_head: nh,
        n_kv_head: nkv,
        head_dim: hd,
    } = s;
    if b == 0 || t == 0 || nh == 0 {
        return;
    }
    let rep = check_shape(s);
    let tl = Tiling::new(s);
    let (w, ow) = (s.qkv_width(), s.out_width());
    let dqkv = &mut dqkv.wide_mut()[..b * t * w];
    let dout = &dout.wide()[..b * t * ow];
    let out = &out.wide()[..b * t * ow];
    let lse = &lse.wide()[..b * nh * t];
    let qkv = &qkv.wide()[..b * t * w];
    let ntasks = b * nkv;
    let groups = tl.slots.min(ntasks);
    let ws = &mut ws.wide_mut()[..groups * tl.slot_len];
    let dqkv = SyncPtr(dqkv.as_mut_ptr());
    be.pool.install(|| {
        ws.par_chunks_mut(tl.slot_len)
            .enumerate()
            .for_each(|(gi, buf)| {
                let mut sl = Slot::split(buf, tl, hd);
                for task in (gi..ntasks).step_by(groups) {
                    let (bi, g) = (task / nkv, task % nkv);
                    let io = Seq {
                        qkv: &qkv[bi * t * w..][..t * w],
                        out: &out[bi * t * ow..][..t * ow],
                        dout: &dout[bi * t * ow..][..t * ow],
                        // SAFETY (for all writes through it): rows of batch bi,
                        // only the columns this (bi, g) task owns.
                        dqkv: unsafe { dqkv.at(bi * t * w) },
                    };
                    // dk, dv of kv head g are accumulated: zero them first.
                    for r in 0..t {
                        for col in [(nh + g) * hd, (nh + nkv + g) * hd] {
                            unsafe { io.dqkv.slice(r * w + col, hd) }.fill(0.0);
                        }
                    }
                    for h in g * rep..(g + 1) * rep {
                        let lse_h = &lse[(bi * nh + h) * t..][..t];
                        for qb in 0..tl.nqb {
                            let r0 = qb * tl.br;
                            let r1 = (r0 + tl.br).min(t);
                            vectorized(
                                #[inline(always)]
                                || backward_block(&mut sl, &io, lse_h, s, tl, (h, g), (r0, r1), o),
                            );
                        }
                    }
                }
            })
    });
}

/// One sequence's inputs, and its rows of `dqkv (T, w)`.
struct Seq<'a> {
    qkv: &'a [f32],
    out: &'a [f32],
    dout: &'a [f32],
    dqkv: SyncPtr,
}

/// Query block `r0..r1` of query head `h` (kv head `g`): writes its dq rows,
/// adds its share into dk, dv of kv head g.
#[inline(always)]
fn backward_block(
    sl: &mut Slot,
    io: &Seq,
    lse: &[f32],
    s: AttnShape,
    tl: Tiling,
    (h, g): (usize, usize),
    (r0, r1): (usize, usize),
    o: AttnOpts,
) {
    let (nh, nkv, hd, w, bc) = (s.n_head, s.n_kv_head, s.head_dim, s.qkv_width(), tl.bc);
    let (scale, ow) = (o.scale, s.out_width());
    let nr = r1 - r0;
    let (qcol, kcol, vcol) = (h * hd, (nh + g) * hd, (nh + nkv + g) * hd);
    let q_row = |r: usize| &io.qkv[r * w + qcol..][..hd];
    let do_row = |r: usize| &io.dout[r * ow + h * hd..][..hd];
    // D_i = rowsum(dO_i * O_i) = rowsum(P_i * dP_i) (FlashAttention-2, eq. in
    // its backward pass): the softmax backward's row term without P or dP.
    let (dd, ll) = (&mut sl.m[..nr], &mut sl.l[..nr]);
    for i in 0..nr {
        let r = r0 + i;
        dd[i] = dot(do_row(r), &io.out[r * ow + h * hd..][..hd]);
        ll[i] = lse[r];
    }
    sl.acc[..nr * hd].fill(0.0);
    for c0 in (first_tile(r0, bc, o.window)..r1).step_by(bc) {
        let nc = bc.min(r1 - c0);
        let (kt, vt) = (&mut sl.kt[..hd * nc], &mut sl.vt[..hd * nc]);
        transpose_tile(kt, io.qkv, w, kcol, c0, nc);
        transpose_tile(vt, io.qkv, w, vcol, c0, nc);
        // Row pass: P, dS, and dQ_i += dS_i K.
        for i in 0..nr {
            let r = r0 + i;
            let live = live_keys(r, c0, nc);
            if live == 0 {
                continue;
            }
            let lo = window_start(r, c0, live, o.window);
            let (q, dy) = (q_row(r), do_row(r));
            // Y_i (live) = cap(scale * q_i K^T), then dP_i (live) = dO_i V^T.
            let prow = &mut sl.s[i * bc..][..live];
            row_times_tile(prow, q, scale, kt, nc);
            if let Some(cap) = o.softcap {
                for y in prow.iter_mut() {
                    *y = softcap(*y, cap);
                }
            }
            let dsrow = &mut sl.dp[i * bc..][..live];
            row_times_tile(dsrow, dy, 1.0, vt, nc);
            // P_i = exp(Y_i - lse_i), dS_i = P_i * (dP_i - D_i) times the soft
            // cap's derivative 1 - (y / cap)², stored times scale: both dQ
            // and dK want dS * scale. Keys before the window weigh 0.
            for (ds, p) in dsrow.iter_mut().zip(prow.iter_mut()) {
                let y = *p;
                let dcap = o.softcap.map_or(1.0, |cap| 1.0 - (y / cap) * (y / cap));
                *p = exp_f32(y - ll[i]);
                *ds = *p * (*ds - dd[i]) * scale * dcap;
            }
            prow[..lo].fill(0.0);
            dsrow[..lo].fill(0.0);
            // dQ_i (hd) += dS_i (live) @ K (live, hd)
            let acc = &mut sl.acc[i * hd..][..hd];
            for (j, &ds) in dsrow.iter().enumerate() {
                axpy(acc, ds, &io.qkv[(c0 + j) * w + kcol..][..hd]);
            }
        }
        // Column pass: dV_j += P^T_j dO, dK_j += dS^T_j Q over the rows that
        // see key c = c0 + j (rows r >= c, whose tile rows were written above).
        for j in 0..nc {
            let c = c0 + j;
            // SAFETY: row c of kv head g's dk and dv columns, owned by this
            // task; no other reference to them is live.
            let dv = unsafe { io.dqkv.slice(c * w + vcol, hd) };
            let dk = unsafe { io.dqkv.slice(c * w + kcol, hd) };
            for i in c.saturating_sub(r0)..nr {
                let r = r0 + i;
                axpy(dv, sl.s[i * bc + j], do_row(r));
                axpy(dk, sl.dp[i * bc + j], q_row(r));
            }
        }
    }
    // SAFETY: rows r0..r1 of head h's dq columns, owned by this task.
    for i in 0..nr {
        let dq = unsafe { io.dqkv.slice((r0 + i) * w + qcol, hd) };
        dq.copy_from_slice(&sl.acc[i * hd..][..hd]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, DType};

    /// xorshift64: deterministic inputs in [-1, 1).
    struct Rng(u64);
    impl Rng {
        fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
            (0..n)
                .map(|_| {
                    self.0 ^= self.0 << 13;
                    self.0 ^= self.0 >> 7;
                    self.0 ^= self.0 << 17;
                    amp * ((self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
                })
                .collect()
        }
    }

    fn shape(b: usize, t: usize, n_head: usize, n_kv_head: usize, head_dim: usize) -> AttnShape {
        AttnShape {
            b,
            t,
            n_head,
            n_kv_head,
            head_dim,
        }
    }

    /// The shapes under test: GQA with a short T; several 64-wide tiles and a
    /// partial one (130 = 64 + 64 + 2); GQA with 3 heads per kv head and a
    /// partial second tile; a single token.
    fn shapes() -> Vec<AttnShape> {
        vec![
            shape(2, 9, 4, 2, 6),
            shape(1, 130, 4, 4, 16),
            shape(1, 70, 6, 2, 8),
            shape(2, 1, 4, 2, 8),
        ]
    }

    fn f32buf(v: &[f32]) -> CpuBuf {
        CpuBuf::F32(v.to_vec())
    }

    /// A buffer of `n` NaNs: kernels must overwrite their outputs and never
    /// read scratch they did not write.
    fn nans(n: usize) -> CpuBuf {
        CpuBuf::F32(vec![f32::NAN; n])
    }

    fn ws(s: AttnShape) -> CpuBuf {
        nans(workspace_bytes(s).div_ceil(4))
    }

    /// Relative and absolute tolerance of every comparison: f32 kernels that
    /// sum in different orders agree to a few ulps of the largest terms.
    const RTOL: f64 = 1e-5;
    const ATOL: f64 = 1e-6;

    fn close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (g as f64 - w).abs();
            assert!(
                err <= RTOL * w.abs() + ATOL,
                "{what}[{i}]: got {g}, want {w} (error {err:e})"
            );
        }
    }

    fn widen(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&v| v as f64).collect()
    }

    /// f64 reference: `out (B,T,H*hd)`, `lse (B,H,T)`, and the backward's
    /// `dqkv` for upstream `dout`, straight from the definitions (full
    /// probability rows, softmax backward with rowsum(P * dP)).
    fn reference(qkv: &[f32], dout: &[f32], s: AttnShape) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (t, nh, nkv, hd) = (s.t, s.n_head, s.n_kv_head, s.head_dim);
        let (w, ow) = (s.qkv_width(), s.out_width());
        let scale = 1.0 / (hd as f64).sqrt();
        let x = widen(qkv);
        let dy = widen(dout);
        let mut out = vec![0.0; s.b * t * ow];
        let mut lse = vec![0.0; s.b * nh * t];
        let mut dx = vec![0.0; s.b * t * w];
        for b in 0..s.b {
            let row = |r: usize, col: usize| (b * t + r) * w + col;
            for h in 0..nh {
                let g = h / (nh / nkv);
                let (qc, kc, vc) = (h * hd, (nh + g) * hd, (nh + nkv + g) * hd);
                for i in 0..t {
                    let dot =
                        |a: usize, c: usize| (0..hd).map(|e| x[a + e] * x[c + e]).sum::<f64>();
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| scale * dot(row(i, qc), row(j, kc)))
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                    lse[(b * nh + h) * t + i] = m + z.ln();
                    let p: Vec<f64> = sc.iter().map(|v| (v - m).exp() / z).collect();
                    let o = (b * t + i) * ow + h * hd;
                    for (j, &pj) in p.iter().enumerate() {
                        for e in 0..hd {
                            out[o + e] += pj * x[row(j, vc) + e];
                        }
                    }
                    // dP_ij = dO_i . v_j; dS = P (dP - sum_j P dP)
                    let dp: Vec<f64> = (0..=i)
                        .map(|j| (0..hd).map(|e| dy[o + e] * x[row(j, vc) + e]).sum())
                        .collect();
                    let pdp: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                    for j in 0..=i {
                        let ds = p[j] * (dp[j] - pdp) * scale;
                        for e in 0..hd {
                            dx[row(j, vc) + e] += p[j] * dy[o + e];
                            dx[row(i, qc) + e] += ds * x[row(j, kc) + e];
                            dx[row(j, kc) + e] += ds * x[row(i, qc) + e];
                        }
                    }
                }
            }
        }
        (out, lse, dx)
    }

    struct Run {
        out: Vec<f32>,
        lse: Vec<f32>,
        dqkv: Vec<f32>,
    }

    /// Fused forward and backward on `threads` threads, outputs prefilled with NaN.
    fn fused(threads: usize, qkv: &[f32], dout: &[f32], s: AttnShape) -> Run {
        let mut be = CpuBackend::new(threads).unwrap();
        let (n, on) = (s.b * s.t * s.qkv_width(), s.b * s.t * s.out_width());
        let (mut out, mut lse, mut ws) = (nans(on), nans(s.b * s.n_head * s.t), ws(s));
        let qkv = f32buf(qkv);
        be.flash_attention_forward(&mut out, &mut lse, &qkv, &mut ws, s);
        let mut dqkv = nans(n);
        be.flash_attention_backward(&mut dqkv, &f32buf(dout), &out, &lse, &qkv, &mut ws, s);
        Run {
            out: out.as_f32().to_vec(),
            lse: lse.as_f32().to_vec(),
            dqkv: dqkv.as_f32().to_vec(),
        }
    }

    /// Eager forward and backward: `(out, dqkv)`.
    fn eager(qkv: &[f32], dout: &[f32], s: AttnShape) -> (Vec<f32>, Vec<f32>) {
        let mut be = CpuBackend::new(2).unwrap();
        let (n, on) = (s.b * s.t * s.qkv_width(), s.b * s.t * s.out_width());
        let an = s.b * s.n_head * s.t * s.t;
        let (mut out, mut att) = (be.alloc(on, DType::F32), be.alloc(an, DType::F32));
        let qkv = f32buf(qkv);
        be.attention_forward(&mut out, &mut att, &qkv, s);
        let (mut dqkv, mut datt) = (be.alloc(n, DType::F32), be.alloc(an, DType::F32));
        be.attention_backward(&mut dqkv, &mut datt, &f32buf(dout), &qkv, &att, s);
        (out.as_f32().to_vec(), dqkv.as_f32().to_vec())
    }

    fn inputs(s: AttnShape, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng(seed);
        // Amplitude 2 makes the softmax rows far from uniform at head_dim 16.
        let qkv = rng.vec(s.b * s.t * s.qkv_width(), 2.0);
        let dout = rng.vec(s.b * s.t * s.out_width(), 1.0);
        (qkv, dout)
    }

    #[test]
    fn forward_matches_eager_and_f64() {
        for (k, s) in shapes().into_iter().enumerate() {
            let (qkv, dout) = inputs(s, 0x9e37_79b9 + k as u64);
            let run = fused(2, &qkv, &dout, s);
            let (want_out, want_lse, _) = reference(&qkv, &dout, s);
            let (eager_out, _) = eager(&qkv, &dout, s);
            close(&run.out, &want_out, &format!("{s:?} out vs f64"));
            close(&run.out, &widen(&eager_out), &format!("{s:?} out vs eager"));
            close(&run.lse, &want_lse, &format!("{s:?} lse vs f64"));
        }
    }

    #[test]
    fn backward_matches_eager_and_f64() {
        for (k, s) in shapes().into_iter().enumerate() {
            let (qkv, dout) = inputs(s, 0x51_7cc1 + k as u64);
            let run = fused(2, &qkv, &dout, s);
            let (_, _, want) = reference(&qkv, &dout, s);
            let (_, eager_dqkv) = eager(&qkv, &dout, s);
            close(&run.dqkv, &want, &format!("{s:?} dqkv vs f64"));
            close(
                &run.dqkv,
                &widen(&eager_dqkv),
                &format!("{s:?} dqkv vs eager"),
            );
        }
    }

    #[test]
    fn single_token_is_its_value_row() {
        // T = 1: the only key is the token itself, so out = v and lse = score.
        let s = shape(1, 1, 2, 1, 4);
        let (qkv, dout) = inputs(s, 7);
        let run = fused(1, &qkv, &dout, s);
        let v = &qkv[(s.n_head + 1) * 4..][..4];
        assert_eq!(&run.out[..4], v);
        assert_eq!(&run.out[4..], v);
        // Nothing flows to q or k: the probability is 1 whatever the score, so
        // dS = P (dP - D) with D = dP up to rounding; dv = dout summed over heads.
        assert!(
            run.dqkv[..12].iter().all(|&d| d.abs() < 1e-6),
            "{:?}",
            run.dqkv
        );
        for e in 0..4 {
            assert_eq!(run.dqkv[12 + e], dout[e] + dout[4 + e], "dv[{e}]");
        }
    }

    #[test]
    fn one_and_two_threads_bit_identical() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        // More tasks than slots in both passes (B*H*nqb = 24, B*KVH = 6).
        let mut all = shapes();
        all.push(shape(3, 100, 4, 2, 16));
        for (k, s) in all.into_iter().enumerate() {
            let (qkv, dout) = inputs(s, 99 + k as u64);
            let (one, two) = (fused(1, &qkv, &dout, s), fused(2, &qkv, &dout, s));
            assert_eq!(bits(&one.out), bits(&two.out), "{s:?} out");
            assert_eq!(bits(&one.lse), bits(&two.lse), "{s:?} lse");
            assert_eq!(bits(&one.dqkv), bits(&two.dqkv), "{s:?} dqkv");
        }
    }

    #[test]
    fn workspace_is_bounded_in_t() {
        let at = |t: usize| workspace_bytes(shape(2, t, 12, 4, 64));
        // The cap: SLOTS slots of full 64 x 64 tiles, whatever T.
        let slot = 2 * BR * BC + 2 * 64 * BC + 2 * BR + BR * 64;
        let cap = 4 * SLOTS * slot;
        for t in [64, 128, 1024, 4096, 1 << 16] {
            assert_eq!(at(t), cap, "T={t}");
        }
        // Below one tile it shrinks with the tiles, never grows past the cap.
        let mut prev = 0;
        for t in 1..=300 {
            assert!(at(t) >= prev && at(t) <= cap, "T={t}");
            prev = at(t);
        }
        // Few (b, head) pairs: slots fill up as query blocks appear, then stop.
        let one = |t: usize| workspace_bytes(shape(1, t, 1, 1, 16));
        let slot16 = 4 * (2 * BR * BC + 2 * 16 * BC + 2 * BR + BR * 16);
        assert_eq!(one(64), slot16);
        assert_eq!(one(BR * SLOTS), SLOTS * slot16);
        assert_eq!(one(1 << 20), SLOTS * slot16);
        assert_eq!(workspace_bytes(shape(0, 5, 2, 2, 8)), 0);
    }
}
