//! The token and position embedding, forward and backward, whole or one
//! vocabulary-parallel part of the table.

use rayon::prelude::*;

use super::math::{add_assign, rows_per_task};
use super::{CpuBackend, CpuBuf};

/// Embedding-table rows per task in `embed_backward`.
const VOCAB_ROWS_PER_TASK: usize = 256;

// out (N,C), tokens (N), wte (V,C), wpe (maxT,C); row r is position r % t.
pub(super) fn forward_rows(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    tokens: &CpuBuf,
    wte: &CpuBuf,
    wpe: Option<&CpuBuf>,
    n: usize,
    t: usize,
    c: usize,
    part: Option<usize>,
) {
    if n == 0 || c == 0 {
        return;
    }
    let out = &mut out.wide_mut()[..n * c];
    let tokens = &tokens.as_u32()[..n];
    let wte = wte.wide();
    let vocab = wte.len() / c;
    let wpe = wpe.map(|p| p.wide());
    let wpe = wpe.as_deref().map(|p| &p[..t * c]);
    let rows = rows_per_task(c);
    be.pool.install(|| {
        out.par_chunks_mut(c * rows)
            .enumerate()
            .for_each(|(ci, blk)| {
                for (ri, o) in blk.chunks_exact_mut(c).enumerate() {
                    let r = ci * rows + ri;
                    let tok = tokens[r] as usize;
                    let row = match part {
                        None => {
                            assert!(tok < vocab, "token id {tok} >= embedding rows {vocab}");
                            Some(tok)
                        }
                        Some(lo) => (lo..lo + vocab).contains(&tok).then(|| tok - lo),
                    };
                    match (row, wpe) {
                        (Some(row), Some(wpe)) => {
                            let e = &wte[row * c..][..c];
                            let p = &wpe[(r % t) * c..][..c];
                            for ((o, a), b) in o.iter_mut().zip(e).zip(p) {
                                *o = a + b;
                            }
                        }
                        (Some(row), None) => o.copy_from_slice(&wte[row * c..][..c]),
                        (None, Some(wpe)) => o.copy_from_slice(&wpe[(r % t) * c..][..c]),
                        (None, None) => o.fill(0.0),
                    }
                }
            })
    });
}

// dwte (V,C) += scatter of dout (N,C) by tokens (N); dwpe (maxT,C) += dout by position.
pub(super) fn backward_rows(
    be: &mut CpuBackend,
    dwte: &mut CpuBuf,
    dwpe: Option<&mut CpuBuf>,
    dout: &CpuBuf,
    tokens: &CpuBuf,
    n: usize,
    t: usize,
    c: usize,
    part: Option<usize>,
) {
    if n == 0 || c == 0 {
        return;
    }
    let mut dwte = dwte.wide_mut();
    let vocab = dwte.len() / c;
    let dwte = &mut dwte[..vocab * c];
    let dout = &dout.wide()[..n * c];
    let tokens = &tokens.as_u32()[..n];
    if part.is_none()
        && let Some(&bad) = tokens.iter().find(|&&tok| tok as usize >= vocab)
    {
        panic!("token id {bad} >= embedding rows {vocab}");
    }
    let lo = part.unwrap_or(0);
    be.pool.install(|| {
        // Several rows may hit the same token, so the scatter is partitioned
        // over the output: each task owns a range of table rows and scans all
        // tokens in order, adding the ones that land in its range. Every
        // element is summed in row order whatever the thread count.
        dwte.par_chunks_mut(c * VOCAB_ROWS_PER_TASK)
            .enumerate()
            .for_each(|(ci, blk)| {
                let v0 = ci * VOCAB_ROWS_PER_TASK;
                let v1 = v0 + blk.len() / c;
                for (r, &tok) in tokens.iter().enumerate() {
                    let Some(tok) = (tok as usize).checked_sub(lo) else {
                        continue;
                    };
                    if (v0..v1).contains(&tok) {
                        add_assign(&mut blk[(tok - v0) * c..][..c], &dout[r * c..][..c]);
                    }
                }
            });
        if let Some(dwpe) = dwpe {
            assert!(
                n.is_multiple_of(t),
                "n = {n} rows is not a multiple of t = {t}"
            );
            // Each task owns a range of positions and sums the B sequences in order.
            let dwpe = &mut dwpe.wide_mut()[..t * c];
            let rows = rows_per_task(c);
            dwpe.par_chunks_mut(c * rows)
                .enumerate()
                .for_each(|(ci, blk)| {
                    for (pi, d) in blk.chunks_exact_mut(c).enumerate() {
                        let pos = ci * rows + pi;
                        for b in 0..n / t {
                            add_assign(d, &dout[(b * t + pos) * c..][..c]);
                        }
                    }
                });
        }
    });
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::testutil::*;

    #[test]
    fn embed_forward_backward() {
        let (v, c, b, t) = (7, 8, 2, 3);
        let n = b * t;
        let mut rng = Rng(1);
        let (wte, wpe) = (rng.vec(v * c), rng.vec(t * c));
        let tokens = vec![3, 0, 3, 6, 3, 1];
        let mut be = be(2);
        let mut out = zeros(n * c);
        be.embed_forward(&mut out, &u(&tokens), &f(&wte), Some(&f(&wpe)), n, t, c);
        let mut want = vec![0.0; n * c];
        for r in 0..n {
            for i in 0..c {
                want[r * c + i] =
                    wte[tokens[r] as usize * c + i] as f64 + wpe[(r % t) * c + i] as f64;
            }
        }
        close(out.as_f32(), &want, FWD, "embed out");
        be.embed_forward(&mut out, &u(&tokens), &f(&wte), None, n, t, c);
        let want: Vec<f64> = (0..n * c)
            .map(|k| wte[tokens[k / c] as usize * c + k % c] as f64)
            .collect();
        close(out.as_f32(), &want, FWD, "embed out (no wpe)");

        let dout = rng.vec(n * c);
        let (dwte0, dwpe0) = (rng.vec(v * c), rng.vec(t * c));
        let (mut dwte, mut dwpe) = (f(&dwte0), f(&dwpe0));
        be.embed_backward(&mut dwte, Some(&mut dwpe), &f(&dout), &u(&tokens), n, t, c);
        let (mut gwte, mut gwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
        for r in 0..n {
            for i in 0..c {
                gwte[tokens[r] as usize * c + i] += dout[r * c + i] as f64;
                gwpe[(r % t) * c + i] += dout[r * c + i] as f64;
            }
        }
        close(dwte.as_f32(), &plus(&dwte0, &gwte), BWD, "dwte");
        close(dwpe.as_f32(), &plus(&dwpe0, &gwpe), BWD, "dwpe");
    }
}
