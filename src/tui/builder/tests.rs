//! The builder's pure update and its drawing, without a terminal; the
//! planner is called where the terminal loop would call it.

use std::sync::Arc;

use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::style::Color;

use super::axes::Axis;
use super::compute::{Change, fixes, match_profile, replan, to_yaml, write_recipe};
use super::state::*;
use crate::tui::app::Key;
use crate::tui::term::default_recipe;

fn builder() -> Builder {
    let mut b = super::new_builder(default_recipe(), std::env::temp_dir(), false);
    // The test machine's GPUs must not change what the tests see.
    b.hardware = super::hardware_choices(&[]);
    b
}

/// Carries out the planner's actions as the terminal loop would, until
/// none is left; returns the other actions.
fn run(b: &mut Builder, mut actions: Vec<Action>) -> Vec<Action> {
    let mut other = Vec::new();
    while let Some(a) = actions.pop() {
        match a {
            Action::Plan(g, r) => {
                actions.extend(update(b, Event::Planned(g, replan(&r).map(Arc::new))))
            }
            Action::Fixes(g, p) => {
                let planned = b.planned.clone().expect("a plan");
                actions.extend(update(b, Event::Fixes(g, p, fixes(&planned, &p))));
            }
            a => other.push(a),
        }
    }
    other
}

fn started() -> Builder {
    let mut b = builder();
    let a = start(&mut b);
    run(&mut b, a);
    b
}

fn key(b: &mut Builder, k: Key) -> Vec<Action> {
    let a = update(b, Event::Key(k));
    run(b, a)
}

/// Puts the form's cursor on `f`.
fn go(b: &mut Builder, f: Field) {
    b.focus = Focus::Form;
    b.field = fields(b).iter().position(|x| *x == f).unwrap();
}

fn draw(b: &Builder, w: u16, h: u16) -> Vec<String> {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| super::render::render(b, f)).unwrap();
    crate::ui::testing::rows(t.backend().buffer())
}

#[test]
fn it_opens_on_the_quickstart_grid_planned() {
    let b = started();
    let p = b.planned.as_ref().expect("planned");
    assert_eq!(p.plan.points.len(), 80);
    assert_eq!(
        b.recipe.grid.framework,
        vec![crate::engine::Framework::Memfit]
    );
    // 4 knobs vary: 16 combinations by 5 micro-batches.
    assert_eq!(b.map.rows.len(), 16);
    assert_eq!(b.map.cols, vec![2, 4, 8, 16, 32]);
    assert!(b.error.is_none());
}

#[test]
fn space_toggles_values_in_their_order_and_keeps_one() {
    let mut b = started();
    go(&mut b, Field::Axis(Axis::Precision));
    b.value = 2; // fp16
    let g = b.generation;
    key(&mut b, Key::Char(' '));
    assert_eq!(b.generation, g + 1);
    assert_eq!(
        Axis::Precision.get(&b.recipe.grid),
        ["fp32", "bf16", "fp16"]
    );
    assert_eq!(b.planned.as_ref().unwrap().plan.points.len(), 120);
    // Off again, then every value but one: the last stays on.
    key(&mut b, Key::Char(' '));
    b.value = 0;
    key(&mut b, Key::Char(' '));
    assert_eq!(Axis::Precision.get(&b.recipe.grid), ["bf16"]);
    b.value = 1;
    let g = b.generation;
    key(&mut b, Key::Char(' '));
    assert_eq!(Axis::Precision.get(&b.recipe.grid), ["bf16"]);
    assert_eq!(b.generation, g, "nothing to re-plan");
    assert!(b.message.as_deref().unwrap().contains("at least one value"));
}

#[test]
fn a_stale_plan_is_dropped() {
    let mut b = started();
    go(&mut b, Field::SeqLen);
    let first = update(&mut b, Event::Key(Key::Left));
    let second = update(&mut b, Event::Key(Key::Left));
    let (Action::Plan(g1, r1), Action::Plan(g2, r2)) = (&first[0], &second[0]) else {
        panic!("{first:?} {second:?}");
    };
    assert_eq!((r1.seq_len, r2.seq_len), (64, 32));
    // The newer answer arrives first; the older one must not replace it.
    update(&mut b, Event::Planned(*g2, replan(r2).map(Arc::new)));
    update(&mut b, Event::Planned(*g1, replan(r1).map(Arc::new)));
    assert_eq!(b.planned.as_ref().unwrap().plan.seq_len, 32);
}

/// The attention kernel cycles from the default through the others; each
/// replans at its published rates (slower than FlashAttention-2 on an
/// A100, the same bytes), and a GPU without its figures says so in one
/// line, keeping the last plan.
#[test]
fn the_attention_kernel_cycles_and_prices_the_fused_points() {
    use crate::config::attention_kernels::AttentionKernel;
    let mut b = started();
    go(&mut b, Field::AttentionKernel);
    key(&mut b, Key::Right);
    assert_eq!(
        b.recipe.attention_kernel,
        Some(AttentionKernel::FlashAttention)
    );
    let e = b
        .error
        .clone()
        .expect("the T4 profile has no attention rates");
    assert!(
        e.contains("gives no rates for the `flash-attention` attention kernel"),
        "{e}"
    );
    key(&mut b, Key::Left);
    assert_eq!(b.recipe.attention_kernel, None);
    b.recipe.hardware = "a100-80gb".into();
    b.recipe.grid.attention = vec![crate::engine::Attention::Fused];
    b.recipe.grid.precision = vec![crate::engine::Precision::Bf16];
    let fa2 = replan(&b.recipe).expect("plans");
    key(&mut b, Key::Right);
    assert!(b.error.is_none(), "{:?}", b.error);
    let fa1 = b.planned.clone().unwrap();
    assert_eq!(fa1.hw.attention_kernel, AttentionKernel::FlashAttention);
    for (x, y) in fa2.plan.points.iter().zip(&fa1.plan.points) {
        assert_eq!(x.total_bytes, y.total_bytes);
        assert!(y.step_s > x.step_s, "{} vs {}", y.step_s, x.step_s);
    }
    assert!(to_yaml(&b.recipe).contains("attention_kernel: flash-attention\n"));
    let rows = draw(&b, 120, 50).join("\n");
    assert!(
        rows.contains("attn_kernel flash-attention (prices fused"),
        "{rows}"
    );
}

#[test]
fn choices_cycle_and_bad_input_is_one_line() {
    let mut b = started();
    go(&mut b, Field::Model);
    key(&mut b, Key::Right);
    assert_eq!(b.recipe.model, "llama-tiny");
    assert_eq!(b.planned.as_ref().unwrap().plan.model, "llama-tiny");
    go(&mut b, Field::Hardware);
    key(&mut b, Key::Right);
    assert_eq!(b.recipe.hardware, "h100-sxm-80gb");
    // A typed path that is not there: one line, the last plan stays.
    go(&mut b, Field::Model);
    key(&mut b, Key::Char('e'));
    for _ in 0..20 {
        key(&mut b, Key::Backspace);
    }
    for c in "/nonexistent/config.json".chars() {
        key(&mut b, Key::Char(c));
    }
    key(&mut b, Key::Enter);
    let e = b.error.clone().expect("an error");
    assert!(e.starts_with("model: "), "{e}");
    assert!(!e.contains('\n'), "{e}");
    assert_eq!(b.planned.as_ref().unwrap().plan.model, "llama-tiny");
    // And it is not written.
    let a = key(&mut b, Key::Char('w'));
    assert!(a.is_empty(), "{a:?}");
    assert!(b.message.as_deref().unwrap().contains("does not plan"));
    // A number that is not one keeps the field open.
    go(&mut b, Field::GlobalBatch);
    key(&mut b, Key::Char('e'));
    key(&mut b, Key::Char('x'));
    key(&mut b, Key::Enter);
    assert!(b.edit.is_some());
    assert!(b.message.as_deref().unwrap().contains("not a whole number"));
    key(&mut b, Key::Esc);
    assert!(b.edit.is_none());
    // Path completion: one candidate fills the field in.
    go(&mut b, Field::Model);
    key(&mut b, Key::Char('e'));
    let a = key(&mut b, Key::Tab);
    let [Action::Complete(prefix)] = a.as_slice() else {
        panic!("{a:?}")
    };
    assert_eq!(prefix, "/nonexistent/config.json");
    update(&mut b, Event::Completed(vec!["profiles/models/".into()]));
    assert_eq!(b.edit.as_deref(), Some("profiles/models/"));
    update(
        &mut b,
        Event::Completed(vec!["recipes/a.yaml".into(), "recipes/ab.yaml".into()]),
    );
    assert_eq!(b.edit.as_deref(), Some("recipes/a"));
    assert_eq!(b.message.as_deref(), Some("a.yaml  ab.yaml"));
}

#[test]
fn an_invalid_grid_says_why_in_one_line() {
    let mut b = started();
    go(&mut b, Field::Axis(Axis::Sharding));
    b.value = 2; // zero1 on one GPU
    key(&mut b, Key::Char(' '));
    let e = b.error.clone().expect("an error");
    assert!(e.contains("zero1 shards state over GPUs"), "{e}");
}

/// The recipe `w` writes plans, through `memfit plan`'s loader, to the
/// very predictions the builder shows, on a grid that sets every kind of key.
#[test]
fn the_written_recipe_plans_to_the_same_predictions() {
    let mut r = default_recipe();
    r.model = "llama-tiny".into();
    r.hardware = "a100-40gb".into();
    r.network = Some("ib-hdr-200".into());
    r.attention_kernel = Some(crate::config::attention_kernels::AttentionKernel::Xformers);
    r.device = Some("cpu:limit=25165825".parse().unwrap());
    r.knobs.lora_rank = Some(4);
    r.grid.framework = vec![
        crate::engine::Framework::Memfit,
        crate::engine::Framework::HfEager,
    ];
    r.grid.finetune = vec![crate::engine::Finetune::Full, crate::engine::Finetune::Lora];
    r.grid.gpus = vec![1, 2];
    r.grid.sharding = vec![crate::engine::Sharding::Ddp, crate::engine::Sharding::Zero2];
    r.grid.precision = vec![crate::engine::Precision::Bf16];
    r.grid.attention = vec![crate::engine::Attention::Fused];
    let shown = replan(&r).expect("plans");
    let dir = std::env::temp_dir().join(format!("memfit-builder-write-{}", std::process::id()));
    let path = write_recipe(&r, &dir).unwrap();
    let written = crate::plan::plan_file_measured(&path).unwrap();
    assert_eq!(
        serde_json::to_value(&written.points).unwrap(),
        serde_json::to_value(&shown.plan.points).unwrap(),
        "{}",
        to_yaml(&r)
    );
    assert_eq!(
        written.recommendation.map(|x| x.index),
        shown.plan.recommendation.map(|x| x.index)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn what_would_make_it_fit_lists_fitting_changes_cheapest_first_one_key_away() {
    let mut b = started();
    b.focus = Focus::Map;
    // mb32, fp32, no checkpointing, eager, adamw: over 24 MiB.
    b.map_row = 0;
    b.map_col = 4;
    let a = key(&mut b, Key::Right);
    assert!(a.is_empty());
    let planned = b.planned.clone().unwrap();
    let i = b.selected().unwrap();
    assert_eq!(
        planned.plan.points[i].verdict,
        crate::plan::Verdict::DoesNotFit
    );
    let f = b.current_fixes().expect("fixes").to_vec();
    assert!(!f.is_empty());
    assert!(
        f.iter()
            .all(|x| x.pred.verdict == crate::plan::Verdict::Fits)
    );
    let costs: Vec<f64> = f
        .iter()
        .filter(|x| !x.pred.excluded)
        .map(|x| x.pred.usd_per_mtok)
        .collect();
    assert!(costs.windows(2).all(|w| w[0] <= w[1]), "{costs:?}");
    // One outside the grid: micro-batch 1. Its number adds it.
    let at = f
        .iter()
        .position(|x| x.changes == [Change::Axis(Axis::MicroBatch, "1".into())])
        .expect("micro_batch 1 fits");
    assert!(!f[at].in_grid);
    key(
        &mut b,
        Key::Char(char::from_digit(at as u32 + 1, 10).unwrap()),
    );
    assert_eq!(b.recipe.grid.micro_batch, vec![1, 2, 4, 8, 16, 32]);
    assert!(b.message.as_deref().unwrap().contains("micro_batch 1"));
    // The selection stays on the same point.
    let p = b.planned.as_ref().unwrap();
    assert_eq!(p.plan.points[b.selected().unwrap()].point.micro_batch, 32);
}

#[test]
fn the_detail_shows_the_split_and_the_neighbours_with_units() {
    let b = started();
    let p = b.planned.clone().unwrap();
    let i = b.selected().unwrap();
    let text: Vec<String> = super::render::detail_lines(&b, &p, i)
        .iter()
        .map(|l| l.to_string().replace('\u{a0}', " "))
        .collect();
    let text = text.join("\n");
    let x = &p.plan.points[i];
    assert!(
        text.contains(&format!(
            "peak {} per GPU",
            crate::units::fmt_bytes(x.total_bytes)
        )),
        "{text}"
    );
    assert!(text.contains("allocations: memfit engine"), "{text}");
    assert!(text.contains("  activations "), "{text}");
    // Every varying knob has its neighbour: the time it costs included.
    for k in [
        "precision bf16: ",
        "checkpointing full: ",
        "attention fused: ",
        "optimizer adamw8bit: ",
    ] {
        assert!(text.contains(k), "{k} in {text}");
    }
    assert!(text.contains("% time"), "{text}");
}

#[test]
fn it_reads_at_80x24_and_draws_without_colour_under_no_color() {
    let mut b = started();
    let screen = draw(&b, 80, 24);
    let all = screen.join("\n");
    assert!(
        screen[0].starts_with("memfit grid builder │ gpt2-tiny on NVIDIA T4"),
        "{all}"
    );
    assert!(all.contains("micro_batch ○1 ●2 ●4 ●8 ●16 ●32"), "{all}");
    assert!(all.contains("● fits ◐ tight ✗ over"), "{all}");
    assert!(all.contains("★ recommended: "), "{all}");
    assert!(screen[23].starts_with("? help q quit"), "{all}");
    assert!(screen[23].contains("r rec w write ⏎ measure"), "{all}");
    for (w, h) in [(1, 1), (10, 3), (30, 10), (60, 18), (80, 24), (200, 60)] {
        assert_eq!(draw(&b, w, h).len(), h as usize);
    }
    // Help reads from the keymap.
    key(&mut b, Key::Char('?'));
    let all = draw(&b, 80, 24).join("\n");
    assert!(all.contains("help: grid builder"), "{all}");
    assert!(all.contains("↓ more"), "{all}");
    assert!(all.contains("write the grid as <out>/recipe.yaml"), "{all}");
    for _ in 0..5 {
        key(&mut b, Key::PageDown);
    }
    let all = draw(&b, 80, 24).join("\n");
    assert!(all.contains("margin = usable - peak"), "{all}");
    assert!(all.contains(" end"), "{all}");
    key(&mut b, Key::Esc);
    assert!(!b.help);
    b.no_color = true;
    let mut t = Terminal::new(TestBackend::new(80, 24)).unwrap();
    t.draw(|f| super::render::render(&b, f)).unwrap();
    for c in t.backend().buffer().content() {
        assert_eq!((c.fg, c.bg), (Color::Reset, Color::Reset), "{c:?}");
    }
}

#[test]
fn local_gpus_map_to_their_profiles() {
    let gib = 1u64 << 30;
    for (name, mem, want) in [
        ("NVIDIA H100 80GB HBM3", 80 * gib, Some("h100-sxm-80gb")),
        ("NVIDIA A100-SXM4-40GB", 40 * gib, Some("a100-40gb")),
        ("NVIDIA A100-SXM4-80GB", 80 * gib, Some("a100-80gb")),
        ("Tesla T4", 15 * gib, Some("t4")),
        ("NVIDIA L4", 22 * gib, Some("l4")),
        ("NVIDIA L40S", 45 * gib, Some("l40s")),
        ("NVIDIA A10G", 22 * gib, Some("a10g")),
        ("NVIDIA GeForce RTX 4090", 24 * gib, Some("rtx-4090")),
        ("NVIDIA RTX A6000", 48 * gib, Some("rtx-a6000")),
        ("NVIDIA B200", 180 * gib, None),
    ] {
        assert_eq!(match_profile(name, mem), want, "{name}");
    }
    let local = vec![crate::telemetry::GpuSample {
        index: 0,
        name: "NVIDIA H100 80GB HBM3".into(),
        memory_used_bytes: 10 * gib,
        memory_total_bytes: 80 * gib,
        utilization_pct: None,
        memory_utilization_pct: None,
        power_w: None,
        power_limit_w: None,
        sm_clock_mhz: None,
        temperature_c: None,
        processes: Vec::new(),
        error: None,
    }];
    let h = super::hardware_choices(&local);
    assert_eq!(h[0].profile, "h100-sxm-80gb");
    assert!(h[0].label.contains("70.00 GiB free"), "{}", h[0].label);
    assert_eq!(h.iter().filter(|x| x.profile == "h100-sxm-80gb").count(), 1);
}

#[test]
fn enter_and_w_ask_to_write_and_sweep_the_grid_as_shown() {
    let mut b = started();
    let a = key(&mut b, Key::Char('w'));
    assert!(
        matches!(a.as_slice(), [Action::Write(r)] if r.grid.micro_batch == b.recipe.grid.micro_batch)
    );
    let a = key(&mut b, Key::Enter);
    assert!(matches!(a.as_slice(), [Action::Sweep(_)]));
    // Not while a change is still being planned.
    go(&mut b, Field::SeqLen);
    update(&mut b, Event::Key(Key::Left));
    let a = key(&mut b, Key::Enter);
    assert!(a.is_empty());
    assert!(b.message.as_deref().unwrap().contains("still planning"));
    assert!(matches!(
        key(&mut b, Key::Char('q')).as_slice(),
        [Action::Quit]
    ));
}

/// A toggle plans only the points it adds; the plan is the one planning
/// the whole grid afresh gives, prediction for prediction.
#[test]
fn the_cached_plan_is_the_fresh_plan() {
    let mut cache = super::compute::Cache::default();
    let mut r = default_recipe();
    r.grid.framework = vec![crate::engine::Framework::Memfit];
    super::compute::replan_cached(&r, &mut cache).unwrap();
    r.grid.precision.push(crate::engine::Precision::Fp16);
    r.grid.micro_batch.retain(|&m| m != 8);
    let cached = super::compute::replan_cached(&r, &mut cache).unwrap();
    let fresh = replan(&r).unwrap();
    assert_eq!(
        serde_json::to_value(&cached.plan.points).unwrap(),
        serde_json::to_value(&fresh.plan.points).unwrap()
    );
    assert_eq!(cached.plan.ranking, fresh.plan.ranking);
    // Another sequence length is another recipe: nothing is reused.
    r.seq_len = 64;
    let cached = super::compute::replan_cached(&r, &mut cache).unwrap();
    let fresh = replan(&r).unwrap();
    assert_eq!(
        serde_json::to_value(&cached.plan.points).unwrap(),
        serde_json::to_value(&fresh.plan.points).unwrap()
    );
}

#[test]
fn r_selects_the_recommended_point_whose_detail_gives_every_reason() {
    let mut b = started();
    key(&mut b, Key::Char('r'));
    let p = b.planned.clone().unwrap();
    let rec = p.plan.recommendation.clone().unwrap();
    assert_eq!(b.selected(), Some(rec.index));
    assert_eq!(b.focus, Focus::Map);
    let text: Vec<String> = super::render::detail_lines(&b, &p, rec.index)
        .iter()
        .map(|l| l.to_string())
        .collect();
    for why in &rec.reasons {
        assert!(text.contains(&format!("  • {why}")), "{why} in {text:?}");
    }
}

/// Where the capacity is the GPU's, a bigger hardware profile is a fix,
/// planned against its own memory.
#[test]
fn a_bigger_gpu_is_a_fix_when_the_capacity_is_the_gpus() {
    let mut r = default_recipe();
    r.model = "gpt2".into();
    r.device = None;
    r.seq_len = 1024;
    r.global_batch = 64;
    r.grid.micro_batch = vec![64];
    r.grid.precision = vec![crate::engine::Precision::Fp32];
    r.grid.checkpointing = vec![crate::engine::Checkpointing::None];
    r.grid.attention = vec![crate::engine::Attention::Eager];
    r.grid.optimizer = vec![crate::engine::Optimizer::Adamw];
    r.grid.framework = vec![crate::engine::Framework::Memfit];
    let p = replan(&r).unwrap();
    let x = &p.plan.points[0];
    assert_eq!(
        x.verdict,
        crate::plan::Verdict::DoesNotFit,
        "{}",
        x.total_bytes
    );
    let f = fixes(&p, &x.point);
    let big: Vec<_> = f
        .iter()
        .filter(|x| matches!(x.changes.as_slice(), [Change::Hardware(_)]))
        .collect();
    assert!(
        !big.is_empty(),
        "{:?}",
        f.iter().map(|x| &x.changes).collect::<Vec<_>>()
    );
    for fix in big {
        assert!(fix.capacity > p.plan.capacity_bytes);
        assert!(fix.pred.margin_bytes >= 0);
    }
}

#[test]
fn a_grid_too_big_to_replan_on_each_key_says_so() {
    let mut r = default_recipe();
    r.grid.gpus = vec![1, 2, 4, 8, 16, 32, 64, 128];
    r.grid.sharding = vec![crate::engine::Sharding::Ddp, crate::engine::Sharding::Zero3];
    r.grid.precision = vec![
        crate::engine::Precision::Fp32,
        crate::engine::Precision::Bf16,
        crate::engine::Precision::Fp16,
    ];
    r.grid.pipeline_stages = vec![1, 2, 4];
    let e = replan(&r).unwrap_err();
    assert!(e.starts_with("the grid has 5760 points"), "{e}");
}

/// A dense model's form has no capacity factor row: each value would be a
/// point the planner refuses.
#[test]
fn a_dense_model_is_offered_no_capacity_factor() {
    let b = started();
    let dense = b.planned.as_ref().expect("the quickstart plans");
    assert!(dense.model.moe.is_none());
    assert!(!fields(&b).contains(&Field::Axis(Axis::CapacityFactor)));
    assert!(fields(&b).contains(&Field::Axis(Axis::Loss)));
}

/// The form offers the capacity factor (dropless first): toggled on for a
/// mixture of experts it plans a point per value, the fit map names them,
/// and the written recipe plans to the same predictions.
#[test]
fn the_capacity_factor_is_an_axis_of_the_form() {
    let mut r = default_recipe();
    r.model = "moe-tiny".into();
    r.grid.framework = vec![crate::engine::Framework::Memfit];
    r.grid.precision = vec![crate::engine::Precision::Bf16];
    r.grid.micro_batch = vec![2];
    let mut b = super::new_builder(r, std::env::temp_dir(), false);
    b.hardware = super::hardware_choices(&[]);
    let a = start(&mut b);
    run(&mut b, a);
    let options = Axis::CapacityFactor.options(&b.recipe.grid);
    assert_eq!(options, ["null", "1.0", "1.25", "1.5", "2.0"]);
    assert_eq!(Axis::CapacityFactor.get(&b.recipe.grid), ["null"]);
    go(&mut b, Field::Axis(Axis::CapacityFactor));
    b.value = 2; // 1.25
    key(&mut b, Key::Char(' '));
    assert_eq!(Axis::CapacityFactor.get(&b.recipe.grid), ["null", "1.25"]);
    let planned = b.planned.clone().unwrap();
    let caps: Vec<_> = (planned.plan.points.iter())
        .map(|p| p.point.capacity_factor.spelled())
        .collect();
    assert!(caps.contains(&"1.25".to_string()) && caps.contains(&"null".to_string()));
    let labels: Vec<&str> = b.map.rows.iter().map(|r| r.label.as_str()).collect();
    assert!(labels.iter().any(|l| l.contains("cf1.25")), "{labels:?}");
    assert!(labels.iter().any(|l| l.contains("dropless")), "{labels:?}");
    assert!(to_yaml(&b.recipe).contains("  capacity_factor: [null, 1.25]\n"));
    let dir = std::env::temp_dir().join(format!("memfit-builder-cap-{}", std::process::id()));
    let path = write_recipe(&b.recipe, &dir).unwrap();
    let written = crate::plan::plan_file_measured(&path).unwrap();
    assert_eq!(
        serde_json::to_value(&written.points).unwrap(),
        serde_json::to_value(&planned.plan.points).unwrap(),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Virtual stages are on the form while the grid has a pipeline (and off
/// it otherwise); toggled on they plan a point per value, the fit map names
/// them, and the written recipe plans to the same predictions.
#[test]
fn virtual_stages_are_an_axis_of_the_form_with_a_pipeline() {
    let b = started();
    assert!(!fields(&b).contains(&Field::Axis(Axis::VirtualStages)));
    let mut r = default_recipe();
    r.grid.framework = vec![crate::engine::Framework::Memfit];
    r.grid.micro_batch = vec![1];
    r.grid.gpus = vec![2];
    r.grid.pipeline_stages = vec![2];
    let mut b = super::new_builder(r, std::env::temp_dir(), false);
    b.hardware = super::hardware_choices(&[]);
    let a = start(&mut b);
    run(&mut b, a);
    assert!(fields(&b).contains(&Field::Axis(Axis::VirtualStages)));
    assert_eq!(
        Axis::VirtualStages.options(&b.recipe.grid),
        ["1", "2", "3", "4"]
    );
    go(&mut b, Field::Axis(Axis::VirtualStages));
    b.value = 1; // 2
    key(&mut b, Key::Char(' '));
    assert_eq!(Axis::VirtualStages.get(&b.recipe.grid), ["1", "2"]);
    let planned = b.planned.clone().unwrap();
    let vs: Vec<usize> = (planned.plan.points.iter())
        .map(|p| p.point.virtual_stages)
        .collect();
    assert!(vs.contains(&1) && vs.contains(&2), "{vs:?}");
    let labels: Vec<&str> = b.map.rows.iter().map(|r| r.label.as_str()).collect();
    assert!(labels.iter().any(|l| l.contains("vpp2")), "{labels:?}");
    assert!(to_yaml(&b.recipe).contains("  virtual_stages: [1, 2]\n"));
    let dir = std::env::temp_dir().join(format!("memfit-builder-vpp-{}", std::process::id()));
    let path = write_recipe(&b.recipe, &dir).unwrap();
    let written = crate::plan::plan_file_measured(&path).unwrap();
    assert_eq!(
        serde_json::to_value(&written.points).unwrap(),
        serde_json::to_value(&planned.plan.points).unwrap(),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Regression: expert parallelism was missing from the builder's axes, so
/// a loaded grid's `expert_parallel` was never on the form and the written
/// recipe dropped it (planning other points than the builder showed).
#[test]
fn expert_parallel_is_on_the_form_and_in_the_written_recipe() {
    let mut r = default_recipe();
    r.model = "moe-tiny".into();
    r.grid.framework = vec![crate::engine::Framework::Memfit];
    r.grid.micro_batch = vec![2];
    r.grid.gpus = vec![2];
    r.grid.sharding = vec![crate::engine::Sharding::Zero2];
    r.grid.expert_parallel = vec![1, 2];
    let mut b = super::new_builder(r, std::env::temp_dir(), false);
    b.hardware = super::hardware_choices(&[]);
    let a = start(&mut b);
    run(&mut b, a);
    assert!(fields(&b).contains(&Field::Axis(Axis::ExpertParallel)));
    assert!(to_yaml(&b.recipe).contains("  expert_parallel: [1, 2]\n"));
    let planned = b.planned.clone().unwrap();
    let dir = std::env::temp_dir().join(format!("memfit-builder-ep-{}", std::process::id()));
    let path = write_recipe(&b.recipe, &dir).unwrap();
    let written = crate::plan::plan_file_measured(&path).unwrap();
    assert_eq!(
        serde_json::to_value(&written.points).unwrap(),
        serde_json::to_value(&planned.plan.points).unwrap(),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Expert parallelism is a row of a mixture's form and tensor-parallel
/// overlap one of a form whose grid lists tensor parallelism; neither is
/// offered where every value would plan the same or be refused.
#[test]
fn expert_parallelism_and_tp_overlap_are_rows_where_they_apply() {
    let b = started();
    assert!(!fields(&b).contains(&Field::Axis(Axis::ExpertParallel)));
    assert!(!fields(&b).contains(&Field::Axis(Axis::TpCommOverlap)));
    let mut r = default_recipe();
    r.model = "moe-tiny".into();
    r.grid.framework = vec![crate::engine::Framework::Memfit];
    r.grid.tensor_parallel = vec![1, 2];
    let mut b = super::new_builder(r, std::env::temp_dir(), false);
    b.hardware = super::hardware_choices(&[]);
    let a = start(&mut b);
    run(&mut b, a);
    assert!(fields(&b).contains(&Field::Axis(Axis::ExpertParallel)));
    assert!(fields(&b).contains(&Field::Axis(Axis::TpCommOverlap)));
    assert_eq!(Axis::ExpertParallel.show("4"), "ep4");
    assert_eq!(Axis::TpCommOverlap.show("true"), "tp-overlap");
}

/// Megatron's parameter-gather overlap is a row only while the grid lists
/// zero1 or zero2, whose gathers of updated weights it overlaps.
#[test]
fn the_param_gather_overlap_is_a_row_with_zero1_or_zero2() {
    let mut r = default_recipe();
    r.grid.sharding = vec![crate::engine::Sharding::Ddp];
    let mut b = builder();
    b.recipe = r.clone();
    assert!(!fields(&b).contains(&Field::Axis(Axis::OverlapParamGather)));
    b.recipe.grid.sharding = vec![crate::engine::Sharding::Ddp, crate::engine::Sharding::Zero2];
    assert!(fields(&b).contains(&Field::Axis(Axis::OverlapParamGather)));
    assert_eq!(
        Axis::OverlapParamGather.show("true"),
        "param-gather-overlap"
    );
    assert_eq!(Axis::OverlapParamGather.label(), "param_ovlp");
}

/// A paged optimizer's point says where its state is: on the GPU and
/// paged out, beside the peak that does not hold it.
#[test]
fn the_detail_says_where_a_paged_optimizers_state_is() {
    let mut r = default_recipe();
    r.model = "gpt2".into();
    r.device = None;
    r.seq_len = 1024;
    r.global_batch = 8;
    r.grid.micro_batch = vec![8];
    r.grid.optimizer = vec![crate::engine::Optimizer::PagedAdamw];
    let mut b = builder();
    b.recipe = r.clone();
    let p = replan(&r).unwrap();
    let x = &p.plan.points[0];
    let g = x.paged.as_ref().expect("a paged point");
    assert_eq!(g.resident_bytes + g.host_bytes, g.bytes);
    let text: Vec<String> = super::render::detail_lines(&b, &p, 0)
        .iter()
        .map(|l| l.to_string().replace('\u{a0}', " "))
        .collect();
    let text = text.join("\n");
    let want = format!(
        "paged optimizer state (unified memory, not in the peak) {}: {} on the GPU",
        crate::units::fmt_bytes(g.bytes),
        crate::units::fmt_bytes(g.resident_bytes)
    );
    assert!(text.contains(&want), "{want} in {text}");
    // The grid builder offers both paged optimizers.
    let offered = super::axes::Axis::Optimizer.options(&r.grid);
    assert!(
        offered.contains(&"paged-adamw8bit".to_string()),
        "{offered:?}"
    );
}

/// hf-eager's `liger` and `compile_loss` keys survive the builder's recipe.
#[test]
fn the_builders_recipe_keeps_liger_and_the_compiled_loss() {
    let yaml = "model: llama-tiny\nhardware: rtx-4090\nseq_len: 64\nglobal_batch: 4\nliger: true\ncompile_loss: true\ngrid:\n  micro_batch: [1, 2]\n  framework: [hf-eager]\n  loss: [chunked]\n";
    let r: crate::plan::PlanRecipe =
        crate::config::profile::parse_yaml(yaml, "r.yaml").expect("parses");
    assert!(r.hf_knobs().liger && r.hf_knobs().compile_loss);
    let written = to_yaml(&r);
    assert!(written.contains("\nliger: true\n"), "{written}");
    assert!(written.contains("\ncompile_loss: true\n"), "{written}");
    let back: crate::plan::PlanRecipe =
        crate::config::profile::parse_yaml(&written, "w.yaml").expect(&written);
    assert!(
        back.hf_knobs().liger && back.hf_knobs().compile_loss,
        "{written}"
    );
}
