//! NF4 storage (src/nf4.rs) against the independent plain-Python reference
//! tests/reference/nf4_reference.py (fixture tests/fixtures/quant/nf4.json),
//! and the round-trip error bound of blockwise absmax quantisation on random
//! data (QLoRA section 3).

use memfit::nf4::{self, ABSMAX_BLOCK, BLOCK, NF4, Nf4};
use memfit::rng::Rng;
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    block: usize,
    absmax_block: usize,
    nf4: Vec<f64>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    n: usize,
    x: Vec<f64>,
    codes: Vec<u8>,
    absmax: Vec<f64>,
    absmax_codes: Vec<i8>,
    absmax_scales: Vec<f64>,
    absmax_mean: f64,
    absmax_dequant: Vec<f64>,
    dequant: Vec<f64>,
    storage_bytes: u64,
}

fn fixture() -> Fixture {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/quant/nf4.json");
    let text = std::fs::read_to_string(path).expect("run tests/reference/nf4_reference.py");
    serde_json::from_str(&text).unwrap()
}

/// |got - want| <= 1e-6 |want| (so a zero must come out zero).
fn assert_close(got: f32, want: f64, what: &str) {
    assert!(
        (got as f64 - want).abs() <= 1e-6 * want.abs(),
        "{what}: got {got} want {want}"
    );
}

#[test]
fn matches_python_reference() {
    let fx = fixture();
    assert_eq!((fx.block, fx.absmax_block), (BLOCK, ABSMAX_BLOCK));
    // serde_json's default parser may be 1 ulp off in f64 on 17 digits; the
    // table's values are f32
    assert_eq!(fx.nf4.iter().map(|&v| v as f32).collect::<Vec<_>>(), NF4);
    assert_eq!(fx.cases.len(), 4);
    // the fixture must cover what it is there for
    let cs = &fx.cases;
    assert!(cs.iter().any(|c| c.n % BLOCK != 0), "no partial last block");
    assert!(
        cs.iter().any(|c| c.absmax.contains(&0.0)),
        "no all-zero block"
    );
    assert!(
        cs.iter().any(|c| c.absmax_scales.len() > 1),
        "no second absmax group"
    );

    for c in cs {
        let name = &c.name;
        assert_eq!(c.x.len(), c.n, "{name}");
        let x: Vec<f32> = c.x.iter().map(|&v| v as f32).collect();
        let q: Nf4 = nf4::quantize(&x);
        assert_eq!(q.numel(), c.n);

        let codes: Vec<u8> = (0..c.n).map(|i| q.code(i)).collect();
        if let Some(i) = (0..c.n).find(|&i| codes[i] != c.codes[i]) {
            panic!(
                "{name}: code[{i}] of x = {} got {} want {}",
                x[i], codes[i], c.codes[i]
            );
        }
        assert_eq!(codes.len(), c.codes.len(), "{name}");
        assert_eq!(
            q.absmax_codes(),
            &c.absmax_codes[..],
            "{name}: absmax codes"
        );

        assert_eq!(q.absmax_scales().len(), c.absmax_scales.len(), "{name}");
        for (g, (&got, &want)) in q.absmax_scales().iter().zip(&c.absmax_scales).enumerate() {
            assert_close(got, want, &format!("{name}: scale[{g}]"));
        }
        assert_close(q.absmax_mean(), c.absmax_mean, &format!("{name}: mean"));
        assert_eq!(c.absmax_dequant.len(), c.n.div_ceil(BLOCK), "{name}");
        for (b, &want) in c.absmax_dequant.iter().enumerate() {
            let true_absmax = x[b * BLOCK..((b + 1) * BLOCK).min(c.n)]
                .iter()
                .fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(true_absmax, c.absmax[b] as f32, "{name}: absmax[{b}]");
            assert_close(
                q.absmax(b),
                want,
                &format!("{name}: dequantised absmax[{b}]"),
            );
        }

        let d = nf4::dequantize(&q);
        assert_eq!(d.len(), c.dequant.len(), "{name}");
        for (i, (&got, &want)) in d.iter().zip(&c.dequant).enumerate() {
            assert_close(got, want, &format!("{name}: dequant[{i}]"));
        }
        let mut d2 = vec![f32::NAN; c.n];
        nf4::dequantize_into(&q, &mut d2);
        assert_eq!(d, d2, "{name}: dequantize_into");

        assert_eq!(nf4::storage_bytes(c.n), c.storage_bytes, "{name}: storage");
        assert_eq!(q.bytes(), c.storage_bytes, "{name}: layout bytes");
        assert_eq!(q.packed().len(), c.n.div_ceil(2), "{name}");
    }
}

/// Values: per 64-block a normal of log-uniform scale (1e-3 .. 10), 1% outliers
/// at 20x, and every 37th block all zero.
fn random_tensor(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n);
    let mut sigma = 1.0;
    for i in 0..n {
        if i % BLOCK == 0 {
            sigma = 10f64.powf(-3.0 + 4.0 * rng.uniform());
        }
        let v = if (i / BLOCK) % 37 == 36 {
            0.0
        } else if rng.below(100) == 0 {
            20.0 * sigma * rng.normal()
        } else {
            sigma * rng.normal()
        };
        x.push(v as f32);
    }
    x
}

/// Per block: max |x - deq(q(x))| <= absmax * (largest NF4 gap)/2 + |absmax -
/// dequantised absmax| (|NF4| <= 1), up to f32 rounding. And the dequantised
/// absmax is within scale/2 of the true one, with scale = max|absmax - mean|
/// / 127 over its own 256 blocks (recomputed here in f64).
#[test]
fn round_trip_error_bound() {
    let half_gap = NF4.windows(2).map(|w| w[1] - w[0]).fold(0.0f32, f32::max) as f64 / 2.0;
    // the widest gap is the first, -1 .. -0.696
    assert!((half_gap - (1.0 - 0.696_192_8) / 2.0).abs() < 1e-7);
    let mut rng = Rng::new(0x4e46_3400);
    let mut tightest = 0.0f64; // largest err / bound seen
    for n in [1, 63, 64, 1000, 16_385, 100_003] {
        let x = random_tensor(&mut rng, n);
        let q = nf4::quantize(&x);
        let d = nf4::dequantize(&q);
        assert_eq!(d.len(), n);
        let absmax: Vec<f64> = x
            .chunks(BLOCK)
            .map(|b| b.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs())))
            .collect();
        let mean = absmax.iter().sum::<f64>() / absmax.len() as f64;
        assert!(
            (q.absmax_mean() as f64 - mean).abs() <= 1e-6 * mean,
            "n {n}: mean"
        );
        assert_eq!(q.absmax_scales().len(), absmax.len().div_ceil(ABSMAX_BLOCK));
        for (g, group) in absmax.chunks(ABSMAX_BLOCK).enumerate() {
            let scale = group.iter().fold(0.0f64, |m, a| m.max((a - mean).abs())) / 127.0;
            let got = q.absmax_scales()[g] as f64;
            assert!(
                (got - scale).abs() <= 1e-5 * scale,
                "n {n}: scale[{g}] {got} vs {scale}"
            );
        }
        for (b, (xs, ds)) in x.chunks(BLOCK).zip(d.chunks(BLOCK)).enumerate() {
            let a = absmax[b];
            let a_deq = q.absmax(b) as f64;
            let scale = q.absmax_scales()[b / ABSMAX_BLOCK] as f64;
            let slack = 1e-6 * (a + mean + 127.0 * scale);
            assert!(
                (a - a_deq).abs() <= scale / 2.0 + slack,
                "n {n} block {b}: absmax {a} dequantised {a_deq} (scale {scale})"
            );
            if a == 0.0 {
                assert!(ds.iter().all(|&v| v == 0.0), "n {n} block {b}: zero block");
                continue;
            }
            let bound = a * half_gap + (a - a_deq).abs();
            let err = xs
                .iter()
                .zip(ds)
                .map(|(&v, &w)| (v as f64 - w as f64).abs())
                .fold(0.0f64, f64::max);
            assert!(
                err <= bound + 1e-6 * (a + a_deq.abs()),
                "n {n} block {b}: error {err} over bound {bound}"
            );
            tightest = tightest.max(err / bound);
        }
    }
    eprintln!("largest error / bound: {tightest:.6}");
    // the bound is attained closely, so the check above has teeth
    assert!(tightest > 0.9, "bound never approached: {tightest}");
}

#[test]
fn bits_per_param_of_large_tensors() {
    for n in [1usize << 24, 7 * (1 << 26), 1 << 33] {
        let bits = nf4::bits_per_param(n);
        eprintln!("NF4 bits per parameter at {n}: {bits:.6}");
        assert!((bits - 4.0 - 0.127).abs() < 5e-4, "{n}: {bits}");
    }
}
