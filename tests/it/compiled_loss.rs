//! `--compile-loss` against what torch.compile's graph of torchtune's
//! chunked loss holds (tests/reference/compiled_loss.json, written by
//! tests/reference/compiled_loss.py from the graphs torch generates):
//! the saved tensors by row, eager and compiled, in bf16 and fp32; the
//! compiled forward's and backward's buffers; and the gradient written into
//! the saved projection output.

use memfit::backend::DType;
use memfit::config::profile::load_model;
use memfit::engine::framework::HfRules;
use memfit::engine::{Framework, Loss, Precision, TrainConfig};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    rows: usize,
    vocab: usize,
    width: usize,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    dtype: String,
    mode: String,
    saved_per_row_bytes: f64,
    #[serde(default)]
    forward_buffers: Vec<Buffer>,
    #[serde(default)]
    backward_buffers: Vec<Buffer>,
    #[serde(default)]
    backward_reuses_saved_logits: bool,
}

#[derive(Deserialize)]
struct Buffer {
    shape: Vec<usize>,
    dtype: String,
}

impl Buffer {
    fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

fn rules(precision: Precision, vocab: usize, compile: bool) -> (HfRules, DType) {
    let mut model = load_model("llama-tiny").unwrap();
    model.vocab_size = vocab;
    let train = TrainConfig {
        framework: Framework::HfEager,
        precision,
        loss: Loss::Chunked,
        compile_loss: compile,
        ..TrainConfig::default()
    };
    memfit::engine::validate::stack(&train, &model).unwrap();
    (HfRules::new(&model, &train, true), precision.dtype())
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/reference/compiled_loss.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn bytes(list: &[(usize, DType)]) -> usize {
    list.iter().map(|&(n, dt)| n * dt.size()).sum()
}

#[test]
fn the_compiled_loss_holds_what_torch_compiles_graph_holds() {
    let f = fixture();
    assert_eq!(
        f.cases.len(),
        5,
        "bf16 and fp32, eager and compiled; 30b8519's"
    );
    for c in f.cases.iter().filter(|c| c.mode != "compiled-ce-only") {
        let precision = match c.dtype.as_str() {
            "bf16" => Precision::Bf16Pure,
            "fp32" => Precision::Fp32,
            other => panic!("{other}"),
        };
        let compiled = c.mode == "compiled";
        let (r, dt) = rules(precision, f.vocab, compiled);
        let at = format!("{} {}", c.dtype, c.mode);
        // Saved: the engine's logits buffer (a row of V in the model's
        // type) and what the rules save beside it.
        let saved = f.vocab * dt.size() + bytes(&r.loss_saved);
        assert_eq!(
            saved as f64, c.saved_per_row_bytes,
            "{at}: saved bytes a row"
        );
        if !compiled {
            continue;
        }
        let rows_of = |b: &Buffer| b.shape.first() == Some(&f.rows);
        // The forward: the projection's output (the engine's buffer, kept)
        // and per-row statistics; nothing else a row of V long, so the
        // rules' tensors alive beside it are none.
        let long = |b: &&Buffer| b.elements() == f.rows * f.vocab;
        assert_eq!(c.forward_buffers.iter().filter(long).count(), 1, "{at}");
        assert!(r.logits.is_empty(), "{at}: {:?}", r.logits);
        let stats: Vec<&Buffer> = (c.forward_buffers.iter())
            .filter(|b| rows_of(b) && b.elements() == f.rows)
            .collect();
        assert_eq!(stats.len(), r.loss_saved.len(), "{at}");
        assert!(stats.iter().all(|b| b.dtype == "float32"), "{at}");
        assert!(r.loss_saved.iter().all(|&(n, d)| n == 1 && d == DType::F32));
        // The backward: the gradient written into the saved output, one
        // fp32 a row beside it, and the hidden rows' gradient (the
        // engine's own buffer).
        assert!(c.backward_reuses_saved_logits, "{at}");
        assert!(!c.backward_buffers.iter().any(|b| long(&b)), "{at}");
        let temps: Vec<&Buffer> = (c.backward_buffers.iter())
            .filter(|b| b.elements() != f.rows * f.width)
            .collect();
        assert_eq!(temps.len(), r.loss_grads.len(), "{at}");
        for (b, &(n, d)) in temps.iter().zip(&r.loss_grads) {
            assert_eq!(
                (b.elements(), b.dtype.as_str()),
                (f.rows * n, "float32"),
                "{at}"
            );
            assert_eq!(d, DType::F32);
        }
    }
}

/// torchtune @ 30b8519 compiled only the upcast and cross-entropy of its
/// `CEWithChunkedOutputLoss`, the chunk's logits an input made in eager:
/// what is saved is the same (the logits and two fp32 a row), but its
/// backward writes the gradient into a new buffer of the logits' type, one
/// part's logits more than `--compile-loss` (bd2a0fc's
/// `LinearCrossEntropyLoss`) holds there; docs/finetuning.md says so.
#[test]
fn the_older_compiled_loss_holds_one_more_part_in_its_backward() {
    let f = fixture();
    let old = (f.cases.iter())
        .find(|c| c.mode == "compiled-ce-only")
        .expect("30b8519's case");
    let (r, dt) = rules(Precision::Bf16Pure, f.vocab, true);
    let saved = f.vocab * dt.size() + bytes(&r.loss_saved);
    assert_eq!(saved as f64, old.saved_per_row_bytes);
    assert!(!old.backward_reuses_saved_logits);
    let long: Vec<&Buffer> = (old.backward_buffers.iter())
        .filter(|b| b.elements() == f.rows * f.vocab)
        .collect();
    assert_eq!(long.len(), 1);
    assert_eq!(long[0].dtype, "bfloat16");
}
