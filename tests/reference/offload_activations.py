"""Reference fixture for memfit's `--offload-activations`: torchtune's own
`OffloadActivations` saved-tensor hooks over a transformers model with
gradient checkpointing, under fake tensors, with device and host bytes
measured apart.

Run by hand (not in CI), from the repository root, in the venv of
hf_memory.py plus torchtune (see tests/reference/README.md):

    ~/.venvs/hfref/bin/pip install --no-deps torchtune==0.6.1 torchao==0.14.1
    ~/.venvs/hfref/bin/pip install psutil
    ~/.venvs/hfref/bin/python tests/reference/offload_activations.py

It writes tests/reference/offload_activations.json.

The step is torchtune's full-finetune recipe's: the forward under the
offloading context (`get_act_offloading_ctx_manager`, whose rule for the
output head is applied to transformers' `lm_head`: a `NoOpManager` around
it, so its saved input stays on the device), the loss outside it, then
backward, AdamW (foreach) and zero_grad(set_to_none=True). Step 1 runs
untracked, step 2 is tracked, as in hf_memory.py.

`OffloadActivations(use_pin_memory=False, use_streams=False)`: without
streams its pack hook copies each saved tensor of at least 1024 bytes that
is not a parameter or buffer into a new cpu tensor (`torch.empty_like(...,
device="cpu")` + `copy_`) and keeps only that; the unpack hook brings it
back with `.to("cuda")` and drops the cpu copy.

What this torch cannot do, and how the script stands in for it (torchtune's
code runs unmodified; see the README):
- torchtune's package `__init__` imports its datasets and recipes' deps
  (`datasets`, `omegaconf`): the module is imported with bare parent
  packages, so only `torchtune.training._activation_offloading` and what it
  imports (`torchtune.modules`, `torchtune.utils`) load.
- `torch.cuda.default_stream()` and `torch.cuda.stream()` need a driver:
  a stand-in stream object and a null context.
- The model runs as fake cpu tensors (fake cuda tensors fail in backward
  here: hf_memory.py's README). So "the device" is cpu, and the unpack
  hook's `.to("cuda")` becomes a copy into a new tensor on it (what a
  host-to-device copy allocates). The host copies are told apart by
  identity: each tensor the pack hook's `empty_like(device="cpu")` makes
  is host memory, every other storage device memory.
"""

import contextlib
import datetime
import importlib.util
import json
import os
import platform
import sys
import types
import weakref

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_memory as hm  # noqa: E402  (its models, tracker and sdpa fix)

# torchtune's module, without its package __init__ (see the docstring).
_spec = importlib.util.find_spec("torchtune")
_root = _spec.submodule_search_locations[0]
for _name, _path in [("torchtune", _root), ("torchtune.training", os.path.join(_root, "training"))]:
    _m = types.ModuleType(_name)
    _m.__path__ = [_path]
    sys.modules[_name] = _m
from torchtune.training._activation_offloading import (  # noqa: E402
    NoOpManager,
    OffloadActivations,
)
import importlib.metadata as _md  # noqa: E402


class _Stream:
    """Stands in for a CUDA stream (never used without use_streams)."""


torch.cuda.default_stream = lambda *a, **k: _Stream()
torch.cuda.stream = lambda s=None: contextlib.nullcontext()


class HostCopies:
    """Marks the pack hook's cpu copies as host memory, and turns the unpack
    hook's `.to("cuda")` into a new tensor on the (fake cpu) device: the two
    torch calls the hooks make, wrapped while a step runs (autograd calls
    the unpack hook where a TorchFunctionMode does not reach)."""

    def __init__(self):
        self.host = weakref.WeakSet()

    @contextlib.contextmanager
    def active(self):
        empty_like, to = torch.empty_like, torch.Tensor.to

        def host_empty_like(*args, **kwargs):
            out = empty_like(*args, **kwargs)
            if str(kwargs.get("device")) == "cpu" and "pin_memory" in kwargs:
                self.host.add(out)
            return out

        def device_to(t, *args, **kwargs):
            if args and str(args[0]) == "cuda":
                return t.clone()
            return to(t, *args, **kwargs)

        torch.empty_like, torch.Tensor.to = host_empty_like, device_to
        try:
            yield
        finally:
            torch.empty_like, torch.Tensor.to = empty_like, to

    def live(self):
        seen, total = set(), 0
        for t in list(self.host):
            s = t.untyped_storage()
            if id(s) not in seen:
                seen.add(id(s))
                total += s.nbytes()
        return total


class DeviceHostTracker(hm.PhaseMemTracker):
    """hf_memory's tracker, with the host copies taken out of the device's
    activations (they are made in the forward) and counted apart."""

    def __init__(self, copies):
        super().__init__()
        self.copies = copies
        self.dev_peak = None
        self.dev_cat_max = {}
        self.host_peak = 0
        self.host_at_dev_peak = 0

    def _update_peak_stats(self, peak_state):
        super()._update_peak_stats(peak_state)
        host = self.copies.live()
        self.host_peak = max(self.host_peak, host)
        for snap in self._curr_mem_snap.values():
            cur = hm.to_memfit(snap)
            cur["activations"] -= host
            cur["total"] -= host
            for k, v in cur.items():
                self.dev_cat_max[k] = max(self.dev_cat_max.get(k, 0), v)
            if self.dev_peak is None or cur["total"] > self.dev_peak["total"]:
                self.dev_peak = dict(cur)
                self.dev_peak_phase = self.phase
                self.host_at_dev_peak = host


CONFIGS = [
    # Shapes no hf_memory.py configuration uses.
    dict(name="gpt2-b2-t512-fp32-sdpa-ckpt-offload", model="gpt2", batch=2, seq_len=512, attention="sdpa"),
    dict(name="gpt2-b3-t256-fp32-eager-ckpt-offload", model="gpt2", batch=3, seq_len=256, attention="eager"),
    # Llama's final RMSNorm is several ops, each saving what it needs.
    dict(name="llama-1b-4l-b2-t192-fp32-sdpa-ckpt-offload", model="llama-1b-4l", batch=2, seq_len=192, attention="sdpa"),
    dict(name="llama-1b-4l-b1-t320-bf16-model-sdpa-ckpt-offload", model="llama-1b-4l", batch=1, seq_len=320, attention="sdpa", dtype="bf16"),
    # Eager attention's (B, 1, T, T) float mask: GPT-2 passes it to each
    # checkpointed block positionally (saved, so offloaded once per block),
    # Llama as a keyword (held by the checkpoint, not saved).
    dict(name="gpt2-b2-t768-fp32-eager-ckpt-offload", model="gpt2", batch=2, seq_len=768, attention="eager"),
    dict(name="gpt2-b1-t640-bf16-model-eager-ckpt-offload", model="gpt2", batch=1, seq_len=640, attention="eager", dtype="bf16"),
    dict(name="llama-1b-4l-b2-t448-fp32-eager-ckpt-offload", model="llama-1b-4l", batch=2, seq_len=448, attention="eager"),
    # bf16 autocast over an fp32 model (a Trainer's `bf16=True`), forward
    # and loss under autocast.
    dict(name="gpt2-b2-t384-bf16-autocast-sdpa-ckpt-offload", model="gpt2", batch=2, seq_len=384, attention="sdpa", autocast=True),
    dict(name="llama-1b-4l-b2-t224-bf16-autocast-sdpa-ckpt-offload", model="llama-1b-4l", batch=2, seq_len=224, attention="sdpa", autocast=True),
]


def run(c):
    torch.manual_seed(0)
    with FakeTensorMode(), torch.device("cpu"):
        # torchtune's dtype bf16: the module itself in bf16, built under a
        # bf16 default dtype (fake parameters cannot be swapped by `.to`).
        previous = torch.get_default_dtype()
        if c.get("dtype") == "bf16":
            torch.set_default_dtype(torch.bfloat16)
        try:
            model, hf_fields = hm.build_model(c["model"], 0.0, c["attention"])
        finally:
            torch.set_default_dtype(previous)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True, fused=False)
        vocab = hf_fields["vocab_size"]
        x = torch.randint(0, vocab, (c["batch"], c["seq_len"]), dtype=torch.long)
        ctx = OffloadActivations(use_pin_memory=False, use_streams=False)
        noop = NoOpManager()
        # torchtune's rule for `model.output`, on transformers' head.
        model.lm_head.register_forward_pre_hook(lambda *a: noop.__enter__())
        model.lm_head.register_forward_hook(lambda *a: noop.__exit__(), always_call=True)
        copies = HostCopies()

        amp = torch.autocast("cpu", dtype=torch.bfloat16) if c.get("autocast") else contextlib.nullcontext()

        def step(mt=None):
            ph = mt.set_phase if mt is not None else (lambda p: None)
            ph("forward")
            with amp:
                with ctx:
                    logits = model(input_ids=x).logits
                loss = model.loss_function(logits=logits, labels=x, vocab_size=vocab)
            del logits
            ph("backward")
            loss.backward()
            del loss
            ph("optimizer")
            opt.step()
            ph("zero_grad")
            opt.zero_grad(set_to_none=True)
            ph("end")

        with copies.active():
            step()
            mt = DeviceHostTracker(copies)
            mt.track_external(model, opt, x)
            with mt:
                mt.set_phase("start")
                step(mt)
        return dict(
            name=c["name"],
            model=c["model"],
            hf_class=type(model).__name__,
            model_config={k: v for k, v in hf_fields.items() if k != "use_cache"},
            batch=c["batch"],
            seq_len=c["seq_len"],
            precision="bf16-model" if c.get("dtype") == "bf16" else "bf16-autocast" if c.get("autocast") else "fp32",
            dropout=0.0,
            attention=c["attention"],
            optimizer="adamw-foreach",
            set_to_none=True,
            checkpointing="non-reentrant",
            offload="torchtune OffloadActivations(use_pin_memory=False, use_streams=False), NoOpManager on lm_head",
            device_peak_bytes=dict(mt.dev_cat_max),
            device_split_at_peak=mt.dev_peak,
            device_peak_phase=mt.dev_peak_phase,
            host_peak_bytes=mt.host_peak,
            host_at_device_peak=mt.host_at_dev_peak,
        )


def main():
    out = dict(
        generated_by="tests/reference/offload_activations.py",
        date=datetime.date.today().isoformat(),
        versions=dict(
            python=platform.python_version(),
            torch=torch.__version__,
            transformers=transformers.__version__,
            torchtune=_md.version("torchtune"),
            torchao=_md.version("torchao"),
        ),
        configs=[],
        failures=[],
    )
    for c in CONFIGS:
        try:
            r = run(c)
            out["configs"].append(r)
            mib = 1 << 20
            print(
                f"{c['name']}: device peak {r['device_split_at_peak']['total'] / mib:.2f} MiB "
                f"({r['device_peak_phase']}), host peak {r['host_peak_bytes'] / mib:.2f} MiB"
            )
        except Exception as e:  # recorded, as hf_memory.py does
            out["failures"].append(dict(name=c["name"], error=f"{type(e).__name__}: {e}"))
            print(f"{c['name']}: FAILED {type(e).__name__}: {e}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "offload_activations.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
