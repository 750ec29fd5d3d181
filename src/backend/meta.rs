//! The `meta` backend: no data, no compute.
//!
//! Its buffers are `()`. The engine runs exactly the same code on it as on cpu,
//! so the tracker sees exactly the same allocations; op costs (FLOPs, bytes) are
//! counted by the engine's device layer, not here.

// The optimizer types are named by `kernel_ops!`'s signatures, which
// resolve here.
use super::{
    AdafactorHyper, AdafactorState, AdamHyper, AttnOpts, AttnShape, Backend, DType, SgdHyper,
    kernel_ops,
};

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

/// `kernel_ops!`'s entries as no-ops: on meta every kernel does nothing,
/// so only the parameters' types are kept (as `_`), none of the names, docs
/// or default bodies.
macro_rules! noop_kernel_ops {
    ($(
        $(#[$attr:meta])*
        fn $name:ident(&mut $self:ident $(, $arg:ident: $ty:ty)* $(,)?) $tail:tt
    )*) => {
        $(fn $name(&mut $self $(, _: $ty)*) {})*
    };
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
    fn download_f32(&self, _src: &()) -> Option<Vec<f32>> {
        None
    }
    fn sum_squares(&mut self, _: &(), _: usize) -> Option<f64> {
        None
    }

    kernel_ops!(noop_kernel_ops);
}
