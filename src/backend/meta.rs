//! The `meta` backend: no data, no compute.
//!
//! Its buffers are `()`. The engine runs exactly the same code on it as on cpu,
//! so the tracker sees exactly the same allocations; op costs (FLOPs, bytes) are
//! counted by the engine's device layer, not here.

use super::{AdafactorHyper, AdafactorState, AdamHyper, AttnShape, Backend, DType, SgdHyper};

/// Which backend's workspace a meta backend declares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Emulates {
    #[default]
    Cpu,
    Cuda,
}

#[derive(Clone, Debug, Default)]
pub struct MetaBackend {
    emulates: Emulates,
    /// A planner's device: what it reads (peaks, the roofline's seconds,
    /// the collectives) is kept, and nothing else (no timeline, no per-op
    /// table, no share of the process's live bytes), which is most of a
    /// plan point's cost when every op is recorded.
    planning: bool,
}

impl MetaBackend {
    /// A meta backend that predicts the cpu backend: it declares the same
    /// workspace (computed by the same function).
    pub fn emulating_cpu() -> Self {
        MetaBackend {
            emulates: Emulates::Cpu,
            planning: false,
        }
    }

    /// A meta backend that predicts the cuda backend, byte for byte.
    pub fn emulating_cuda() -> Self {
        MetaBackend {
            emulates: Emulates::Cuda,
            planning: false,
        }
    }

    pub fn emulates(&self) -> Emulates {
        self.emulates
    }

    /// This backend for the planner (see `planning`).
    pub fn for_planning(self) -> Self {
        MetaBackend {
            planning: true,
            ..self
        }
    }
}

impl Backend for MetaBackend {
    type Buf = ();

    fn name(&self) -> &'static str {
        "meta"
    }
    fn holds_data(&self) -> bool {
        false
    }
    fn planning(&self) -> bool {
        self.planning
    }
    fn is_gpu(&self) -> bool {
        self.emulates == Emulates::Cuda
    }
    fn offloads(&self) -> bool {
        true
    }
    fn reads_nf4(&self) -> bool {
        true
    }
    fn alloc(&mut self, _len: usize, _dtype: DType) {}
    fn free(&mut self, _buf: ()) {}
    fn workspace_bytes(&self, s: AttnShape, fused: bool, dtype: DType) -> usize {
        match self.emulates {
            Emulates::Cpu => super::cpu::workspace_bytes(s, fused),
            Emulates::Cuda => super::cuda::workspace_bytes(s, fused, dtype),
        }
    }
    fn upload_f32(&mut self, _dst: &mut (), _src: &[f32]) {}
    fn upload_u32(&mut self, _dst: &mut (), _src: &[u32]) {}
    fn convert(&mut self, _dst: &mut (), _src: &(), _n: usize) {}
    fn copy_slice(&mut self, _: &mut (), _: usize, _: &(), _: usize, _: usize, _: bool) {}
    fn download_f32(&self, _src: &()) -> Option<Vec<f32>> {
        None
    }
    fn fill(&mut self, _buf: &mut (), _value: f32) {}
    fn layernorm_forward(
        &mut self,
        _: &mut (),
        _: &mut (),
        _: &mut (),
        _: &(),
        _: &(),
        _: Option<&()>,
        _: usize,
        _: usize,
        _: f32,
    ) {
    }
    fn layernorm_backward(
        &mut self,
        _: &mut (),
        _: &mut (),
        _: Option<&mut ()>,
        _: &(),
        _: &(),
        _: &(),
        _: &(),
        _: &(),
        _: usize,
        _: usize,
    ) {
    }
    fn rmsnorm_forward(
        &mut self,
        _: &mut (),
        _: &mut (),
        _: &(),
        _: &(),
        _: usize,
        _: usize,
        _: f32,
    ) {
    }
    fn rmsnorm_backward(
        &mut self,
        _: &mut (),
        _: &mut (),
        _: &(),
        _: &(),
        _: &(),
        _: &(),
        _: usize,
        _: usize,
    ) {
    }
    fn matmul_forward(
        &mut self,
        _: &mut (),
        _: &(),
        _: &(),
        _: Option<&()>,
        _: usize,
        _: usize,
        _: usize,
    ) {
    }
    fn copy_cols(
        &mut self,
        _: &mut (),
        _: usize,
        _: usize,
        _: &(),
        _: usize,
        _: usize,
        _: usize,
        _: usize,
        _: f32,
        _: bool,
    ) {
    }
    fn matmul_backward(
        &mut self,
        _: &mut (),
        _: Option<&mut ()>,
        _: Option<&mut ()>,
        _: &(),
        _: &(),
        _: &(),
        _: usize,
        _: usize,
        _: usize,
    ) {
    }
    fn gelu_forward(&mut self, _: &mut (), _: &(), _: usize) {}
    fn gelu_backward(&mut self, _: &mut (), _: &(), _: usize) {}
    fn swiglu_forward(&mut self, _: &mut (), _: &(), _: usize, _: usize) {}
    fn swiglu_backward(&mut self, _: &mut (), _: &(), _: &(), _: usize, _: usize) {}
    fn add(&mut self, _: &mut (), _: &(), _: &(), _: usize) {}
    fn moe_gather(&mut self, _: &mut (), _: &(), _: &(), _: Option<&()>, _: (usize, usize, usize)) {
    }
    fn moe_scatter(
        &mut self,
        _: &mut (),
        _: &(),
        _: &(),
        _: Option<&()>,
        _: (usize, usize, usize),
    ) {
    }
    fn moe_row_dots(&mut self, _: &mut (), _: &(), _: &(), _: &(), _: (usize, usize, usize)) {}
    fn grouped_matmul_forward(
        &mut self,
        _: &mut (),
        _: &(),
        _: &(),
        _: &[usize],
        _: usize,
        _: usize,
    ) {
    }
    #[allow(clippy::too_many_arguments)]
    fn grouped_matmul_backward(
        &mut self,
        _: &mut (),
        _: Option<&mut ()>,
        _: &(),
        _: &(),
        _: &(),
        _: &[usize],
        _: usize,
        _: usize,
    ) {
    }
    fn rope_forward(&mut self, _: &mut (), _: AttnShape, _: f32) {}
    fn rope_backward(&mut self, _: &mut (), _: AttnShape, _: f32) {}
    fn attention_forward(&mut self, _: &mut (), _: &mut (), _: &(), _: AttnShape) {}
    fn attention_backward(&mut self, _: &mut (), _: &mut (), _: &(), _: &(), _: &(), _: AttnShape) {
    }
    fn crossentropy_forward(&mut self, _: &mut (), _: &(), _: &(), _: usize, _: usize, _: usize) {}
    fn crossentropy_part_stats(
        &mut self,
        _: &mut (),
        _: &mut (),
        _: &(),
        _: &(),
        _: usize,
        _: usize,
        _: usize,
        _: usize,
    ) {
    }
    fn crossentropy_combine(&mut self, _: &mut (), _: &mut (), _: &(), _: &(), _: usize, _: usize) {
    }
    fn crossentropy_part_backward(
        &mut self,
        _: &mut (),
        _: &(),
        _: &(),
        _: f32,
        _: usize,
        _: usize,
        _: usize,
        _: usize,
    ) {
    }
    fn embed_forward_rows(
        &mut self,
        _: &mut (),
        _: &(),
        _: &(),
        _: Option<&()>,
        _: usize,
        _: usize,
        _: usize,
        _: Option<usize>,
    ) {
    }
    fn embed_backward_rows(
        &mut self,
        _: &mut (),
        _: Option<&mut ()>,
        _: &(),
        _: &(),
        _: usize,
        _: usize,
        _: usize,
        _: Option<usize>,
    ) {
    }
    fn crossentropy_backward(&mut self, _: &mut (), _: &(), _: f32, _: usize, _: usize, _: usize) {}
    fn sum_squares(&mut self, _: &(), _: usize) -> Option<f64> {
        None
    }
    fn adamw_update(&mut self, _: &mut (), _: &(), _: &mut (), _: &mut (), _: usize, _: AdamHyper) {
    }
    fn flash_attention_forward(
        &mut self,
        _: &mut (),
        _: &mut (),
        _: &(),
        _: &mut (),
        _: AttnShape,
    ) {
    }
    fn flash_attention_backward(
        &mut self,
        _: &mut (),
        _: &(),
        _: &(),
        _: &(),
        _: &(),
        _: &mut (),
        _: AttnShape,
    ) {
    }
    fn adamw8bit_update(
        &mut self,
        _: &mut (),
        _: &(),
        _: &mut (),
        _: &mut (),
        _: &mut (),
        _: &mut (),
        _: usize,
        _: AdamHyper,
    ) {
    }
    fn sgd_update(&mut self, _: &mut (), _: &(), _: &mut (), _: usize, _: SgdHyper) {}
    fn adafactor_update(
        &mut self,
        _: &mut (),
        _: &(),
        _: AdafactorState<'_, ()>,
        _: AdafactorHyper,
    ) {
    }
}
