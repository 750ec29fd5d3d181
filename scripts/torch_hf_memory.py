"""What PyTorch's CUDA caching allocator holds for one Hugging Face training
step, against memfit's hf-eager plan of it; for scripts/gpu-check.sh.

For each configuration: build the model from its config (random weights,
nothing downloaded; tests/reference/hf_memory.py's MODELS and build_model),
run step 1, reset the peak statistics, run step 2 (the steady state memfit
plans), and read torch.cuda.max_memory_allocated / max_memory_reserved.
memfit's figures come from `memfit plan --format json` on a one-point recipe
(hf-eager, an H200 profile): the point's `allocator` peaks, which model the
same allocator over the engine's allocations. Prints one JSON list.
"""
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location(
    "hf_memory", os.path.join(ROOT, "tests", "reference", "hf_memory.py")
)
hfm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hfm)

BIN = os.environ.get("MEMFIT_BIN", os.path.join(ROOT, "target", "release", "memfit"))
# (model, memfit model, batch, seq, precision, dropout, attention, optimizer impl, set_to_none)
CONFIGS = [
    ("gpt2", "gpt2", 4, 1024, "fp32", 0.0, "eager", "foreach", True),
    ("gpt2", "gpt2", 4, 1024, "fp32", 0.1, "eager", "foreach", False),
    ("gpt2", "gpt2", 4, 1024, "bf16", 0.0, "sdpa", "foreach", True),
    ("gpt2", "gpt2", 4, 64, "fp32", 0.0, "eager", "single-tensor", True),
    ("llama-3.2-1b", "llama-3.2-1b", 4, 1024, "fp32", 0.0, "eager", "foreach", True),
    ("llama-3.2-1b", "llama-3.2-1b", 4, 1024, "bf16", 0.0, "sdpa", "foreach", True),
]


def torch_step(model_name, b, t, prec, drop, attn, impl, stn):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model, hf = hfm.build_model(model_name, drop, attn)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.01,
        foreach=(impl == "foreach"), fused=(impl == "fused"),
    )
    x = torch.randint(0, hf["vocab_size"], (b, t), device="cuda")
    ac = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if prec == "bf16" else contextlib.nullcontext

    def step():
        with ac():
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=stn)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    out = dict(
        max_memory_allocated=torch.cuda.max_memory_allocated(),
        max_memory_reserved=torch.cuda.max_memory_reserved(),
    )
    del model, opt, x
    torch.cuda.empty_cache()
    return out


def memfit_plan(mf_model, b, t, prec, drop, attn, impl, stn):
    recipe = (
        f"model: {mf_model}\nhardware: h200-141gb\nseq_len: {t}\nglobal_batch: {b}\n"
        f"dropout: {drop}\noptimizer_impl: {impl}\nset_to_none: {str(stn).lower()}\n"
        f"grid:\n  micro_batch: [{b}]\n  precision: [{prec}]\n"
        f"  attention: [{'fused' if attn == 'sdpa' else 'eager'}]\n  framework: [hf-eager]\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(recipe)
    r = subprocess.run([BIN, "plan", f.name, "--format", "json"], capture_output=True, text=True)
    os.unlink(f.name)
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    p = json.loads(r.stdout)["points"][0]
    return dict(p["allocator"], engine_total=p["peak_bytes"]["total"])


res = []
for m, mf, b, t, prec, drop, attn, impl, stn in CONFIGS:
    name = f"{m}-b{b}-t{t}-{prec}-d{drop:g}-{attn}-{impl}{'' if stn else '-zero'}"
    row = {"config": name}
    try:
        row["torch"] = torch_step(m, b, t, prec, drop, attn, impl, stn)
    except Exception as e:  # an OOM or an API change: say so, go on
        row["torch_error"] = repr(e)
    row["memfit"] = memfit_plan(mf, b, t, prec, drop, attn, impl, stn)
    tq, mq = row.get("torch"), row["memfit"]
    if tq and "error" not in mq:
        for k in ("max_memory_allocated", "max_memory_reserved"):
            row[f"{k}_error"] = mq[k] / tq[k] - 1
    res.append(row)
    print(json.dumps(row), file=sys.stderr)
print(json.dumps({"torch": torch.__version__, "rows": res}, indent=1))
