//! Row-wise ops on the GPU: embedding, LayerNorm, RMSNorm, RoPE,
//! cross-entropy, sum of squares (`kernels/norm.cu`).
//!
//! Launch shapes (the kernels' comments say why):
//! * LayerNorm/RMSNorm rows: one warp per row, [`NORM_WARPS`] rows a block.
//! * Embedding forward and cross-entropy: one block per row (grid-stride over
//!   rows), threads striding the row, block reductions.
//! * Parameter gradients over rows (norm dw/db): column blocks of 32 with 8
//!   row lanes, split over row ranges into fp32 partials in the backend
//!   scratch when there are too few column blocks to fill the GPU; the
//!   partials are added in split order. `dwte`: blocks own 32 table rows and
//!   scan the token ids in order. Nothing uses float atomics: every result is
//!   the same bits run to run.

use super::check::{FLOATS, Harness, Tol, both, down, up, up_u32};
use super::driver::{Arg, Driver, LaunchCfg};
use super::{CudaBackend, CudaBuf, PARTIALS, QMAP_OFFSET, n64};
use crate::backend::{AttnShape, Backend, DType};

/// Warps (rows) per block of the warp-per-row kernels.
const NORM_WARPS: usize = 4;
/// Table rows one block of `embed_backward_wte_kernel` owns (`NORM_VOCAB_ROWS` in norm.cu).
const VOCAB_ROWS: usize = 32;
/// Most blocks of a block-per-row grid-stride launch.
const MAX_ROW_BLOCKS: usize = 1 << 16;
/// Blocks the weight-gradient split aims for: a few per SM of an H100/H200.
const WGRAD_BLOCKS: usize = 528;
/// Fewest rows one split of the weight-gradient sums gets.
const WGRAD_MIN_ROWS: usize = 16;
/// Elements of `sum_squares` per block before it uses more blocks.
const SUMSQ_PER_BLOCK: usize = 2048;

/// Threads of a block that strides a row of `len` elements: a multiple of 32
/// (block reductions and ballots need whole warps), at most `max`.
fn row_threads(len: usize, max: usize) -> u32 {
    (len.div_ceil(32) * 32).clamp(32, max) as u32
}

/// One block per row, grid-stride beyond [`MAX_ROW_BLOCKS`] rows.
fn per_row(n: usize, threads: u32) -> LaunchCfg {
    LaunchCfg::linear(n.min(MAX_ROW_BLOCKS) as u32, threads)
}

/// One warp per row.
fn warp_per_row(n: usize) -> LaunchCfg {
    LaunchCfg::linear(n.div_ceil(NORM_WARPS) as u32, (32 * NORM_WARPS) as u32)
}

pub(crate) fn embed_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    tokens: &CudaBuf,
    wte: &CudaBuf,
    wpe: Option<&CudaBuf>,
    n: usize,
    t: usize,
    c: usize,
    part: Option<usize>,
) {
    if n == 0 || c == 0 {
        return;
    }
    assert!(t > 0, "embed_forward with t = 0");
    let vocab = wte.len / c;
    // Without wpe the kernel never reads its pointer; pass wte's.
    let p = wpe.unwrap_or(wte);
    be.launch(
        "embed_forward_kernel",
        per_row(n, row_threads(c, 256)),
        &[
            out.arg(),
            out.dt(),
            tokens.arg(),
            wte.arg(),
            wte.dt(),
            p.arg(),
            p.dt(),
            Arg::I32(wpe.is_some() as i32),
            n64(n),
            n64(t),
            n64(c),
            n64(vocab),
            n64(part.unwrap_or(0)),
            Arg::I32(part.is_some() as i32),
        ],
    );
}

pub(crate) fn embed_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dwte: &mut CudaBuf,
    dwpe: Option<&mut CudaBuf>,
    dout: &CudaBuf,
    tokens: &CudaBuf,
    n: usize,
    t: usize,
    c: usize,
    lo: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    let vocab = dwte.len / c;
    if vocab > 0 {
        // Block (x, y): table rows [32x, 32x + 32), columns [y*threads, ...).
        let threads = row_threads(c, 256);
        let cfg = LaunchCfg {
            grid: [
                vocab.div_ceil(VOCAB_ROWS) as u32,
                c.div_ceil(threads as usize) as u32,
                1,
            ],
            block: [threads, 1, 1],
            shared_bytes: 0,
        }
        .with_shared(VOCAB_ROWS * threads as usize * 4);
        be.launch(
            "embed_backward_wte_kernel",
            cfg,
            &[
                dwte.arg(),
                dwte.dt(),
                dout.arg(),
                dout.dt(),
                tokens.arg(),
                n64(n),
                n64(c),
                n64(vocab),
                n64(lo),
            ],
        );
    }
    if let Some(dwpe) = dwpe {
        assert!(
            t > 0 && n.is_multiple_of(t),
            "n = {n} rows is not a multiple of t = {t}"
        );
        be.launch(
            "embed_backward_wpe_kernel",
            LaunchCfg::elementwise(t * c),
            &[
                dwpe.arg(),
                dwpe.dt(),
                dout.arg(),
                dout.dt(),
                n64(n / t),
                n64(t),
                n64(c),
            ],
        );
    }
}

pub(crate) fn layernorm_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    mean: &mut CudaBuf,
    rstd: &mut CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    b: Option<&CudaBuf>,
    n: usize,
    c: usize,
    eps: f32,
) {
    if n == 0 || c == 0 {
        return;
    }
    let bb = b.unwrap_or(w);
    be.launch(
        "layernorm_forward_kernel",
        warp_per_row(n),
        &[
            out.arg(),
            out.dt(),
            mean.arg(),
            mean.dt(),
            rstd.arg(),
            rstd.dt(),
            inp.arg(),
            inp.dt(),
            w.arg(),
            w.dt(),
            bb.arg(),
            bb.dt(),
            Arg::I32(b.is_some() as i32),
            n64(n),
            n64(c),
            Arg::F32(eps),
        ],
    );
}

pub(crate) fn layernorm_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dinp: &mut CudaBuf,
    dw: &mut CudaBuf,
    db: Option<&mut CudaBuf>,
    dout: &CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    mean: &CudaBuf,
    rstd: &CudaBuf,
    n: usize,
    c: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    be.launch(
        "layernorm_backward_kernel",
        warp_per_row(n),
        &[
            dinp.arg(),
            dinp.dt(),
            dout.arg(),
            dout.dt(),
            inp.arg(),
            inp.dt(),
            w.arg(),
            w.dt(),
            mean.arg(),
            mean.dt(),
            rstd.arg(),
            rstd.dt(),
            n64(n),
            n64(c),
        ],
    );
    wgrad(be, dw, db, dout, inp, Some(mean), rstd, n, c);
}

pub(crate) fn rmsnorm_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    rstd: &mut CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    n: usize,
    c: usize,
    eps: f32,
) {
    if n == 0 || c == 0 {
        return;
    }
    be.launch(
        "rmsnorm_forward_kernel",
        warp_per_row(n),
        &[
            out.arg(),
            out.dt(),
            rstd.arg(),
            rstd.dt(),
            inp.arg(),
            inp.dt(),
            w.arg(),
            w.dt(),
            n64(n),
            n64(c),
            Arg::F32(eps),
        ],
    );
}

pub(crate) fn rmsnorm_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dinp: &mut CudaBuf,
    dw: &mut CudaBuf,
    dout: &CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    rstd: &CudaBuf,
    n: usize,
    c: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    be.launch(
        "rmsnorm_backward_kernel",
        warp_per_row(n),
        &[
            dinp.arg(),
            dinp.dt(),
            dout.arg(),
            dout.dt(),
            inp.arg(),
            inp.dt(),
            w.arg(),
            w.dt(),
            rstd.arg(),
            rstd.dt(),
            n64(n),
            n64(c),
        ],
    );
    wgrad(be, dw, None, dout, inp, None, rstd, n, c);
}

/// `dw (C) += sum_r dout * norm`, `db (C) += sum_r dout` for LayerNorm (with
/// `mean`) or RMSNorm (without): `norm_wgrad_partial_kernel`, split over row
/// ranges when the column blocks alone are too few for the GPU and the
/// partials fit the scratch, then `norm_wgrad_finish_kernel` adds them.
fn wgrad<D: Driver>(
    be: &mut CudaBackend<D>,
    dw: &mut CudaBuf,
    db: Option<&mut CudaBuf>,
    dout: &CudaBuf,
    inp: &CudaBuf,
    mean: Option<&CudaBuf>,
    rstd: &CudaBuf,
    n: usize,
    c: usize,
) {
    let col_blocks = c.div_ceil(32);
    let per_split = if db.is_some() { 2 * c } else { c };
    // The partials live below the quantisation maps, fp32 each.
    let fits = (QMAP_OFFSET / 4) / per_split;
    let nsplit = n
        .div_ceil(WGRAD_MIN_ROWS)
        .min(WGRAD_BLOCKS.div_ceil(col_blocks))
        .min(fits)
        .max(1);
    let has_db = db.is_some();
    let (db_arg, db_dt) = match &db {
        Some(d) => (d.arg(), d.dt()),
        None => (dw.arg(), dw.dt()),
    };
    let m = mean.unwrap_or(rstd);
    let scratch = Arg::Ptr(be.scratch);
    be.launch(
        "norm_wgrad_partial_kernel",
        LaunchCfg {
            grid: [col_blocks as u32, nsplit as u32, 1],
            block: [32, 8, 1],
            shared_bytes: 0,
        },
        &[
            dw.arg(),
            dw.dt(),
            db_arg,
            db_dt,
            Arg::I32(has_db as i32),
            scratch,
            dout.arg(),
            dout.dt(),
            inp.arg(),
            inp.dt(),
            m.arg(),
            m.dt(),
            rstd.arg(),
            rstd.dt(),
            Arg::I32(mean.is_none() as i32),
            n64(n),
            n64(c),
            n64(nsplit),
        ],
    );
    if nsplit > 1 {
        be.launch(
            "norm_wgrad_finish_kernel",
            LaunchCfg::elementwise(c),
            &[
                dw.arg(),
                dw.dt(),
                db_arg,
                db_dt,
                Arg::I32(has_db as i32),
                scratch,
                n64(c),
                n64(nsplit),
            ],
        );
    }
}

/// RoPE in place; `sign` 1 rotates, -1 rotates back.
pub(crate) fn rope<D: Driver>(
    be: &mut CudaBackend<D>,
    qkv: &mut CudaBuf,
    s: AttnShape,
    theta: f32,
    sign: f32,
) {
    let hd = s.head_dim;
    let n = s.b * s.t;
    if n == 0 || hd == 0 {
        return;
    }
    assert!(
        hd.is_multiple_of(2),
        "rope needs an even head_dim, got {hd}"
    );
    be.launch(
        "rope_kernel",
        LaunchCfg::elementwise(n * hd / 2),
        &[
            qkv.arg(),
            qkv.dt(),
            n64(n),
            n64(s.t),
            n64(s.qkv_width()),
            Arg::I32((s.n_head + s.n_kv_head) as i32),
            Arg::I32(hd as i32),
            Arg::F32(theta),
            Arg::F32(sign),
        ],
    );
}

fn check_vocab(v: usize, vp: usize) {
    assert!(
        v > 0 && v <= vp,
        "cross-entropy needs 0 < v <= vp, got v={v} vp={vp}"
    );
}

pub(crate) fn crossentropy_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    losses: &mut CudaBuf,
    logits: &CudaBuf,
    targets: &CudaBuf,
    n: usize,
    v: usize,
    vp: usize,
) {
    if n == 0 {
        return;
    }
    check_vocab(v, vp);
    be.launch(
        "crossentropy_forward_kernel",
        per_row(n, row_threads(v, 512)),
        &[
            losses.arg(),
            losses.dt(),
            logits.arg(),
            logits.dt(),
            targets.arg(),
            n64(n),
            n64(v),
            n64(vp),
        ],
    );
}

pub(crate) fn crossentropy_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    logits: &mut CudaBuf,
    targets: &CudaBuf,
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
) {
    if n == 0 {
        return;
    }
    check_vocab(v, vp);
    be.launch(
        "crossentropy_backward_kernel",
        per_row(n, row_threads(v, 512)),
        &[
            logits.arg(),
            logits.dt(),
            targets.arg(),
            Arg::F32(dloss),
            n64(n),
            n64(v),
            n64(vp),
        ],
    );
}

pub(crate) fn crossentropy_part_stats<D: Driver>(
    be: &mut CudaBackend<D>,
    stats: &mut CudaBuf,
    tgt: &mut CudaBuf,
    logits: &CudaBuf,
    targets: &CudaBuf,
    n: usize,
    lo: usize,
    v: usize,
    vp: usize,
) {
    if n == 0 {
        return;
    }
    assert!(
        v <= vp,
        "cross-entropy part needs v <= vp, got v={v} vp={vp}"
    );
    be.launch(
        "crossentropy_part_stats_kernel",
        per_row(n, row_threads(v.max(1), 512)),
        &[
            stats.arg(),
            tgt.arg(),
            logits.arg(),
            logits.dt(),
            targets.arg(),
            n64(n),
            n64(lo),
            n64(v),
            n64(vp),
        ],
    );
}

pub(crate) fn crossentropy_combine<D: Driver>(
    be: &mut CudaBackend<D>,
    losses: &mut CudaBuf,
    lse: &mut CudaBuf,
    stats: &CudaBuf,
    tgt: &CudaBuf,
    n: usize,
    parts: usize,
) {
    if n == 0 {
        return;
    }
    be.launch(
        "crossentropy_combine_kernel",
        LaunchCfg::elementwise(n),
        &[
            losses.arg(),
            lse.arg(),
            stats.arg(),
            tgt.arg(),
            n64(n),
            n64(parts),
        ],
    );
}

pub(crate) fn crossentropy_part_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    logits: &mut CudaBuf,
    lse: &CudaBuf,
    targets: &CudaBuf,
    dloss: f32,
    n: usize,
    lo: usize,
    v: usize,
    vp: usize,
) {
    if n == 0 {
        return;
    }
    be.launch(
        "crossentropy_part_backward_kernel",
        per_row(n, row_threads(vp.max(1), 512)),
        &[
            logits.arg(),
            logits.dt(),
            lse.arg(),
            targets.arg(),
            Arg::F32(dloss),
            n64(n),
            n64(lo),
            n64(v),
            n64(vp),
        ],
    );
}

pub(crate) fn sum_squares<D: Driver>(be: &mut CudaBackend<D>, buf: &CudaBuf, n: usize) -> f64 {
    if n == 0 {
        return 0.0;
    }
    assert!(n <= buf.len, "sum_squares of {n} elements of {}", buf.len);
    // The block count depends on n only, so the partials (and their sum in
    // block order) are the same bits every time.
    let blocks = n.div_ceil(SUMSQ_PER_BLOCK).clamp(1, PARTIALS);
    let scratch = Arg::Ptr(be.scratch);
    be.launch(
        "sum_squares_kernel",
        LaunchCfg::linear(blocks as u32, 256),
        &[scratch, buf.arg(), buf.dt(), n64(n)],
    );
    be.sum_partials(blocks)
}

// ----------------------------------------------------------------------------
// Checks against the cpu backend (see check.rs).

/// Forward tolerance: fp32 sums of up to a few hundred terms in another order.
const FWD: Tol = Tol::new(1e-5, 1e-5);
/// Backward tolerance (gradients with cancellation, sums over rows).
const BWD: Tol = Tol::new(1e-5, 1e-4);

/// `[out, dwte, dwpe?]`: forward, then backward into gradients that start
/// non-zero (the op accumulates).
fn embed<B: Backend>(
    be: &mut B,
    tokens: &[u32],
    wte: &[f32],
    wpe: Option<&[f32]>,
    dout: &[f32],
    (dwte0, dwpe0): (&[f32], &[f32]),
    (n, t, c): (usize, usize, usize),
    dt: DType,
) -> Vec<Vec<f32>> {
    let tb = up_u32(be, tokens);
    let wteb = up(be, wte, dt);
    let wpeb = wpe.map(|p| up(be, p, dt));
    let mut out = up(be, &vec![f32::NAN; n * c], dt);
    be.embed_forward(&mut out, &tb, &wteb, wpeb.as_ref(), n, t, c);
    let doutb = up(be, dout, dt);
    let mut dwte = up(be, dwte0, dt);
    let mut dwpe = wpe.map(|_| up(be, dwpe0, dt));
    be.embed_backward(&mut dwte, dwpe.as_mut(), &doutb, &tb, n, t, c);
    let mut r = vec![down(be, &out), down(be, &dwte)];
    if let Some(p) = dwpe {
        r.push(down(be, &p));
    }
    r
}

/// `[out, mean, rstd]` of LayerNorm (`mean: false`: RMSNorm, `[out, rstd]`);
/// the statistics are fp32, as the engine keeps them.
fn norm_fwd<B: Backend>(
    be: &mut B,
    layer: bool,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    (n, c): (usize, usize),
    eps: f32,
    dt: DType,
) -> Vec<Vec<f32>> {
    let (xb, wb) = (up(be, x, dt), up(be, w, dt));
    let bb = b.map(|b| up(be, b, dt));
    let mut out = up(be, &vec![f32::NAN; n * c], dt);
    let mut mean = up(be, &vec![f32::NAN; n], DType::F32);
    let mut rstd = up(be, &vec![f32::NAN; n], DType::F32);
    if layer {
        be.layernorm_forward(
            &mut out,
            &mut mean,
            &mut rstd,
            &xb,
            &wb,
            bb.as_ref(),
            n,
            c,
            eps,
        );
        vec![down(be, &out), down(be, &mean), down(be, &rstd)]
    } else {
        be.rmsnorm_forward(&mut out, &mut rstd, &xb, &wb, n, c, eps);
        vec![down(be, &out), down(be, &rstd)]
    }
}

/// `[dinp, dw, db?]` of LayerNorm (`mean` given) or RMSNorm, from the same
/// statistics on both backends and gradients that start non-zero.
fn norm_bwd<B: Backend>(
    be: &mut B,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    (mean, rstd): (Option<&[f32]>, &[f32]),
    (dx0, dw0, db0): (&[f32], &[f32], Option<&[f32]>),
    (n, c): (usize, usize),
    dt: DType,
) -> Vec<Vec<f32>> {
    let (xb, wb, dyb) = (up(be, x, dt), up(be, w, dt), up(be, dy, dt));
    let rb = up(be, rstd, DType::F32);
    let (mut dx, mut dw) = (up(be, dx0, dt), up(be, dw0, dt));
    let mut db = db0.map(|d| up(be, d, dt));
    match mean {
        Some(m) => {
            let mb = up(be, m, DType::F32);
            be.layernorm_backward(
                &mut dx,
                &mut dw,
                db.as_mut(),
                &dyb,
                &xb,
                &wb,
                &mb,
                &rb,
                n,
                c,
            );
        }
        None => be.rmsnorm_backward(&mut dx, &mut dw, &dyb, &xb, &wb, &rb, n, c),
    }
    let mut r = vec![down(be, &dx), down(be, &dw)];
    if let Some(db) = db {
        r.push(down(be, &db));
    }
    r
}

/// `[rope_forward(x), rope_backward(g)]`.
fn rope_both<B: Backend>(
    be: &mut B,
    x: &[f32],
    g: &[f32],
    s: AttnShape,
    theta: f32,
    dt: DType,
) -> Vec<Vec<f32>> {
    let mut xb = up(be, x, dt);
    be.rope_forward(&mut xb, s, theta);
    let mut gb = up(be, g, dt);
    be.rope_backward(&mut gb, s, theta);
    vec![down(be, &xb), down(be, &gb)]
}

/// `[losses, dlogits]`: losses fp32 (as the engine keeps them), the gradient
/// in place in the logits buffer.
fn crossentropy<B: Backend>(
    be: &mut B,
    logits: &[f32],
    targets: &[u32],
    (n, v, vp): (usize, usize, usize),
    dt: DType,
) -> Vec<Vec<f32>> {
    let lb = up(be, logits, dt);
    let tb = up_u32(be, targets);
    let mut losses = up(be, &vec![f32::NAN; n], DType::F32);
    be.crossentropy_forward(&mut losses, &lb, &tb, n, v, vp);
    let mut g = up(be, logits, dt);
    be.crossentropy_backward(&mut g, &tb, 1.0 / n as f32, n, v, vp);
    vec![down(be, &losses), down(be, &g)]
}

/// The vocabulary-parallel embedding and cross-entropy of a group of
/// `parts` ranks, run part by part on one backend, the collectives done on
/// the host: `[embedding (parts summed), dwte parts stitched, losses,
/// dlogits parts stitched]` (`vp` divisible by `parts`).
fn vocab_parallel<B: Backend>(
    be: &mut B,
    tokens: &[u32],
    wte: &[f32],
    dout: &[f32],
    logits: &[f32],
    (n, c, v, vp): (usize, usize, usize, usize),
    parts: usize,
    dt: DType,
) -> Vec<Vec<f32>> {
    let rows = vp / parts;
    let tb = up_u32(be, tokens);
    let (mut emb, mut dwte) = (vec![0.0f32; n * c], Vec::new());
    let (mut stats, mut tgt) = (Vec::new(), vec![0.0f32; n]);
    let mut bufs = Vec::new();
    for p in 0..parts {
        let lo = p * rows;
        let real = v.saturating_sub(lo).min(rows);
        let w = up(be, &wte[lo * c..(lo + rows) * c], dt);
        let mut out = up(be, &vec![f32::NAN; n * c], dt);
        be.embed_forward_rows(&mut out, &tb, &w, None, n, n, c, Some(lo));
        for (e, x) in emb.iter_mut().zip(down(be, &out)) {
            *e += x;
        }
        let mut dw = up(be, &vec![0.0; rows * c], dt);
        let db = up(be, dout, dt);
        be.embed_backward_rows(&mut dw, None, &db, &tb, n, n, c, Some(lo));
        dwte.extend(down(be, &dw));
        let part: Vec<f32> = (0..n)
            .flat_map(|r| logits[r * vp + lo..][..rows].to_vec())
            .collect();
        let lb = up(be, &part, dt);
        let mut st = up(be, &vec![f32::NAN; 2 * n], DType::F32);
        let mut tg = up(be, &vec![f32::NAN; n], DType::F32);
        be.crossentropy_part_stats(&mut st, &mut tg, &lb, &tb, n, lo, real, rows);
        stats.extend(down(be, &st));
        for (a, b) in tgt.iter_mut().zip(down(be, &tg)) {
            *a += b;
        }
        bufs.push((lb, lo, real));
    }
    let mut losses = up(be, &vec![f32::NAN; n], DType::F32);
    let mut lse = up(be, &vec![f32::NAN; n], DType::F32);
    let (sb, tb2) = (up(be, &stats, DType::F32), up(be, &tgt, DType::F32));
    be.crossentropy_combine(&mut losses, &mut lse, &sb, &tb2, n, parts);
    let mut dlogits = vec![0.0f32; n * vp];
    for (mut lb, lo, real) in bufs {
        be.crossentropy_part_backward(&mut lb, &lse, &tb, 1.0 / n as f32, n, lo, real, rows);
        for (r, row) in down(be, &lb).chunks(rows).enumerate() {
            dlogits[r * vp + lo..][..rows].copy_from_slice(row);
        }
    }
    vec![emb, dwte, down(be, &losses), dlogits]
}

fn sumsq<B: Backend>(be: &mut B, x: &[f32], dt: DType) -> Vec<Vec<f32>> {
    let xb = up(be, x, dt);
    // Skip the last element: `n` below the buffer's length is honoured.
    let s = be
        .sum_squares(&xb, x.len() - 1)
        .expect("a backend with data");
    vec![vec![s as f32]]
}

/// Cases for `memfit selftest` and `cargo test` (see `check.rs`).
pub(crate) fn check_cases<D: Driver>(h: &mut Harness<D>) {
    for &dt in &FLOATS {
        check_embed(h, dt);
        check_norms(h, dt);
        check_rope(h, dt);
        check_crossentropy(h, dt);
        check_vocab_parallel(h, dt);
        check_sumsq(h, dt);
    }
}

fn check_embed<D: Driver>(h: &mut Harness<D>, dt: DType) {
    // (b, t, c, vocab, maxT, wpe): one column and one row; repeated
    // tokens over several 32-row table blocks; several 256-column blocks
    // and token tiles.
    for (b, t, c, v, max_t, wpe) in [
        (1usize, 1usize, 1usize, 1usize, 1usize, true),
        (2, 3, 37, 70, 5, true),
        (10, 13, 64, 100, 16, false),
        (2, 150, 300, 45, 160, true),
    ] {
        let n = b * t;
        let tokens = h.tokens(n, v);
        let wte = h.randn(v * c, 1.0);
        let wpe_v = h.randn(max_t * c, 1.0);
        let dout = h.randn(n * c, 1.0);
        let dwte0 = h.randn(v * c, 0.5);
        let dwpe0 = h.randn(max_t * c, 0.5);
        let wpe = wpe.then_some(wpe_v.as_slice());
        let (cr, gr) = both!(
            h,
            embed(&tokens, &wte, wpe, &dout, (&dwte0, &dwpe0), (n, t, c), dt)
        );
        let names: &[&str] = if wpe.is_some() {
            &["out", "dwte", "dwpe"]
        } else {
            &["out", "dwte"]
        };
        h.compare(
            "embed fwd+bwd",
            format!(
                "n={n} t={t} c={c} v={v}{}",
                if wpe.is_some() { " +wpe" } else { "" }
            ),
            dt,
            names,
            &cr,
            &gr,
            BWD,
        );
    }
}

fn check_norms<D: Driver>(h: &mut Harness<D>, dt: DType) {
    // (n, c, bias): one column; odd widths; enough rows to split the
    // weight gradient over row ranges (n > 16); GPT-2's width.
    for (n, c, bias) in [
        (1usize, 1usize, true),
        (5, 37, true),
        (64, 300, false),
        (33, 768, true),
    ] {
        let x: Vec<f32> = h.randn(n * c, 2.0).iter().map(|v| v + 0.5).collect();
        let w = h.randn(c, 1.0);
        let bv = h.randn(c, 0.5);
        let dy = h.randn(n * c, 1.0);
        let dx0 = h.randn(n * c, 0.5);
        let dw0 = h.randn(c, 0.5);
        let db0 = h.randn(c, 0.5);
        let b = bias.then_some(bv.as_slice());
        let eps = 1e-5;
        for layer in [true, false] {
            let shape = format!("n={n} c={c}{}", if layer && bias { " +bias" } else { "" });
            let b = if layer { b } else { None };
            let (cr, gr) = both!(h, norm_fwd(layer, &x, &w, b, (n, c), eps, dt));
            let (op, names): (&str, &[&str]) = if layer {
                ("layernorm fwd", &["out", "mean", "rstd"])
            } else {
                ("rmsnorm fwd", &["out", "rstd"])
            };
            h.compare(op, shape.clone(), dt, names, &cr, &gr, FWD);
            // The backward reads the cpu's statistics on both backends.
            let mean = layer.then_some(cr[1].as_slice());
            let rstd = cr[cr.len() - 1].as_slice();
            let db0 = (layer && bias).then_some(db0.as_slice());
            let (cb, gb) = both!(
                h,
                norm_bwd(&x, &w, &dy, (mean, rstd), (&dx0, &dw0, db0), (n, c), dt)
            );
            let (op, names): (&str, &[&str]) = match (layer, db0.is_some()) {
                (true, true) => ("layernorm bwd", &["dinp", "dw", "db"]),
                (true, false) => ("layernorm bwd", &["dinp", "dw"]),
                _ => ("rmsnorm bwd", &["dinp", "dw"]),
            };
            h.compare(op, shape.clone(), dt, names, &cb, &gb, BWD);
        }
    }
}

fn check_rope<D: Driver>(h: &mut Harness<D>, dt: DType) {
    // Grouped-query shapes (n_kv_head < n_head), an odd head count, a
    // head_dim of 6 (half = 3), positions up to 299.
    for (s, theta) in [
        (
            AttnShape {
                b: 2,
                t: 5,
                n_head: 4,
                n_kv_head: 2,
                head_dim: 8,
            },
            10_000.0f32,
        ),
        (
            AttnShape {
                b: 1,
                t: 9,
                n_head: 3,
                n_kv_head: 1,
                head_dim: 6,
            },
            10_000.0,
        ),
        (
            AttnShape {
                b: 1,
                t: 300,
                n_head: 2,
                n_kv_head: 1,
                head_dim: 64,
            },
            500_000.0,
        ),
    ] {
        let len = s.b * s.t * s.qkv_width();
        let x = h.randn(len, 1.0);
        let g = h.randn(len, 1.0);
        let (cr, gr) = both!(h, rope_both(&x, &g, s, theta, dt));
        h.compare(
            "rope fwd (+1) / bwd (-1)",
            format!(
                "b={} t={} h={}/{} hd={}",
                s.b, s.t, s.n_head, s.n_kv_head, s.head_dim
            ),
            dt,
            &["forward", "backward"],
            &cr,
            &gr,
            Tol::new(1e-6, 1e-5),
        );
    }
}

fn check_crossentropy<D: Driver>(h: &mut Harness<D>, dt: DType) {
    // (n, v, vp): a one-column vocabulary; padded columns holding garbage.
    for (n, v, vp) in [
        (1usize, 1usize, 1usize),
        (6, 10, 12),
        (37, 300, 320),
        (64, 257, 257),
    ] {
        let mut logits = h.randn(n * vp, 4.0);
        for r in 0..n {
            for (k, j) in (v..vp).enumerate() {
                logits[r * vp + j] = if k % 2 == 0 { 1e4 } else { f32::NAN };
            }
        }
        let targets = h.tokens(n, v);
        let (cr, gr) = both!(h, crossentropy(&logits, &targets, (n, v, vp), dt));
        h.compare(
            "crossentropy fwd+bwd",
            format!("n={n} v={v} vp={vp}"),
            dt,
            &["losses", "dlogits"],
            &cr,
            &gr,
            Tol::new(1e-6, 1e-5),
        );
    }
}

fn check_vocab_parallel<D: Driver>(h: &mut Harness<D>, dt: DType) {
    // The vocabulary-parallel embedding and loss: 2 and 4 parts, the
    // last holding some padding or only padding.
    for (n, c, v, vp, parts) in [
        (6usize, 8usize, 10usize, 12usize, 2usize),
        (37, 40, 90, 128, 4),
        (64, 16, 257, 260, 4),
    ] {
        let tokens = h.tokens(n, v);
        let wte = h.randn(vp * c, 1.0);
        let dout = h.randn(n * c, 1.0);
        let logits = h.randn(n * vp, 4.0);
        let (cr, gr) = both!(
            h,
            vocab_parallel(&tokens, &wte, &dout, &logits, (n, c, v, vp), parts, dt)
        );
        h.compare(
            "vocab-parallel embed + crossentropy",
            format!("n={n} c={c} v={v} vp={vp} parts={parts}"),
            dt,
            &["embed", "dwte", "losses", "dlogits"],
            &cr,
            &gr,
            Tol::new(1e-5, 1e-4),
        );
    }
}

fn check_sumsq<D: Driver>(h: &mut Harness<D>, dt: DType) {
    // One element; one block; the most blocks (PARTIALS) with a tail.
    for n in [2usize, 5000, PARTIALS * SUMSQ_PER_BLOCK + 777] {
        let x = h.randn(n, 1.0);
        let (cr, gr) = both!(h, sumsq(&x, dt));
        h.compare(
            "sum_squares",
            format!("n={}", n - 1),
            dt,
            &["sum"],
            &cr,
            &gr,
            Tol::new(0.0, 1e-6),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{crossentropy, embed, norm_bwd, sumsq, vocab_parallel};
    use crate::backend::DType;
    use crate::backend::cuda::CudaBackend;
    use crate::backend::cuda::check::{table, tests};

    /// No float atomics: the ops with reductions across blocks (the dwte
    /// scatter, the split weight gradients, the sum of squares) give the same
    /// bits on every run, although the emulator runs blocks on several threads.
    #[test]
    fn cross_block_reductions_are_deterministic() {
        let mut h = tests::harness(5);
        let (n, t, c, v) = (96, 48, 40, 7);
        let tokens = h.tokens(n, v);
        let wte = h.randn(v * c, 1.0);
        let wpe = h.randn(t * c, 1.0);
        let x = h.randn(n * c, 1.0);
        let w = h.randn(c, 1.0);
        let stats = h.uniform(n, 0.5, 2.0);
        let big = h.randn(300_000, 1.0);
        let dt = DType::Bf16;
        let run = |be: &mut CudaBackend<_>| {
            let mut r = embed(
                be,
                &tokens,
                &wte,
                Some(&wpe),
                &x,
                (&wte, &wpe),
                (n, t, c),
                dt,
            );
            r.extend(norm_bwd(
                be,
                &x,
                &w,
                &x,
                (Some(&stats), &stats),
                (&x, &w, Some(&w)),
                (n, c),
                dt,
            ));
            r.extend(sumsq(be, &big, DType::F32));
            r.iter()
                .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        };
        let first = run(&mut h.gpu);
        for _ in 0..3 {
            assert!(run(&mut h.gpu) == first, "a cross-block reduction changed");
        }
    }

    /// On the cpu backend, the vocabulary-parallel parts put together are
    /// the whole embedding and cross-entropy, whether a part holds real
    /// rows, some padding or only padding.
    #[test]
    fn vocab_parallel_parts_make_the_whole() {
        let mut be = crate::backend::cpu::CpuBackend::new(2).unwrap();
        let mut h = tests::harness(6);
        for (n, c, v, vp, parts) in [
            (6usize, 8usize, 10usize, 12usize, 2usize),
            (37, 40, 90, 128, 4),
        ] {
            let tokens = h.tokens(n, v);
            let wte = h.randn(vp * c, 1.0);
            let dout = h.randn(n * c, 1.0);
            let mut logits = h.randn(n * vp, 4.0);
            for r in 0..n {
                logits[r * vp + v..][..vp - v].fill(0.0);
            }
            let got = vocab_parallel(
                &mut be,
                &tokens,
                &wte,
                &dout,
                &logits,
                (n, c, v, vp),
                parts,
                DType::F32,
            );
            let whole = embed(
                &mut be,
                &tokens,
                &wte,
                None,
                &dout,
                (&vec![0.0; vp * c], &[]),
                (n, n, c),
                DType::F32,
            );
            let ce = crossentropy(&mut be, &logits, &tokens, (n, v, vp), DType::F32);
            let close = |a: &[f32], b: &[f32], tol: f32, what: &str| {
                assert_eq!(a.len(), b.len(), "{what}");
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{what}: {x} vs {y}");
                }
            };
            assert_eq!(
                got[0], whole[0],
                "embedding: one part adds a row, the others 0"
            );
            assert_eq!(got[1], whole[1], "dwte: each part's rows");
            close(&got[2], &ce[0], 1e-6, "losses");
            close(&got[3], &ce[1], 1e-6, "dlogits");
        }
    }

    #[test]
    fn row_ops_match_cpu_on_the_emulated_gpu() {
        let mut h = tests::harness(4);
        super::check_cases(&mut h);
        eprintln!("{}", table(&h.rows));
        tests::assert_all_pass(&h);
    }
}
