#!/usr/bin/env bash
# One call that proves the cuda backend on a real NVIDIA GPU (under 8 minutes
# on one H200). The GPU machine may have no Rust toolchain and no network:
# build elsewhere (`cargo build --release && strip -o memfit-stripped
# target/release/memfit`, about 10 MB), copy the binary and this checkout,
# and run `MEMFIT_BIN=./memfit-stripped bash scripts/gpu-check.sh`.
#   0. `memfit doctor`: driver, GPUs, the NVRTC/cuBLAS/NCCL/NVML files found
#      and their versions, PyTorch's CUDA (it stops here when --device cuda
#      lacks something),
#   1. the binary: $MEMFIT_BIN, else target/release/memfit, else a build,
#   2. `memfit selftest --device cuda`: every op against the cpu backend,
#      gpt2-tiny and llama-tiny trained on both, meta == cuda peaks,
#   2b. `memfit calibrate --device cuda --force`: the GPU's GEMM curve per
#      dtype, fused attention by sequence length at head dims 64 and 128, bandwidth and
#      per-kernel overhead (printed into summary.txt; the JSON in the logs),
#      then the same GPT-2 plan with and without the measurement,
#   3. GPT-2 124M, bf16, B=16, T=1024, fused attention, AdamW: tokens/s and
#      MFU from the engine's own FLOP count,
#   4. NVML: a one-trial gpt2 bf16 sweep, whose NVML per-process peak must
#      lie within the tracked peak + 5% + the measured start-up overhead,
#   5. when PyTorch is importable, the same model and step in PyTorch eager
#      (scripts/torch_gpt2_step.py) for a side-by-side ratio,
#   6. when transformers is importable too, Hugging Face GPT-2 and
#      Llama-3.2-1B steps (scripts/torch_hf_memory.py): max_memory_allocated
#      and max_memory_reserved against memfit's hf-eager plan of each,
#   7. ranks as processes on the GPU (`memfit launch`): a world of one
#      through NCCL (ddp: its all-reduce; zero2 needs two ranks on cuda),
#      then two ranks on cuda:0 with zero2 staged through the host
#      (MEMFIT_DIST_BACKEND=tcp: NCCL refuses two ranks on one GPU), and a
#      tensor-parallel pair the same way, each against the same run on
#      threads: losses and peaks must match.
# At most 8 files reach $OUT (or ./gpu-check-out): summary.txt, doctor.json,
# selftest.json, gpu-check.json and logs.tar.gz (every other report and log).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
W="$(mktemp -d)"
log() { echo "== $*" | tee -a "$W/summary.txt"; }
finish() {
    cp "$W/summary.txt" "$OUT/" 2>/dev/null
    for f in doctor.json selftest.json gpu-check.json; do
        [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"
    done
    tar -czf "$OUT/logs.tar.gz" -C "$W" . 2>/dev/null
}
trap finish EXIT

log "gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | tee -a "$W/summary.txt"

BIN="${MEMFIT_BIN:-target/release/memfit}"
if [ ! -x "$BIN" ]; then
    if ! command -v cargo >/dev/null 2>&1; then
        log "no memfit binary at $BIN and no cargo to build one: set MEMFIT_BIN"
        exit 2
    fi
    log "building memfit"
    cargo build --release 2>&1 | tail -3
fi
"$BIN" --version | tee -a "$W/summary.txt"

log "doctor"
"$BIN" doctor --format json >"$W/doctor.json" 2>/dev/null
DOCTOR_RC=$?
"$BIN" doctor 2>&1 | tee -a "$W/summary.txt"
if [ "$DOCTOR_RC" != 0 ]; then
    log "memfit doctor says --device cuda lacks something (above): stopping"
    exit 1
fi

log "selftest"
timeout 300 "$BIN" selftest --device cuda --format json >"$W/selftest.json" 2>"$W/selftest.err"
SELFTEST_RC=$?
timeout 120 "$BIN" selftest --device cuda --steps 5 >"$W/selftest.txt" 2>&1 || true
tail -n 25 "$W/selftest.txt" | tee -a "$W/summary.txt"
log "selftest exit code $SELFTEST_RC (0 = every comparison passed)"

log "calibrate --device cuda (GEMM, fused attention, bandwidth curves)"
# A scratch cache: the measurement is this run's, whatever the machine holds.
export MEMFIT_CACHE_DIR="$W/cache"
timeout 180 "$BIN" calibrate --device cuda --force >"$W/calibrate.txt" 2>&1
echo "exit $?" >>"$W/calibrate.txt"
cat "$W/calibrate.txt" | tee -a "$W/summary.txt"
timeout 60 "$BIN" calibrate --device cuda --format json >"$W/calibrate.json" 2>>"$W/calibrate.txt"
# The GPT-2 step of step 3, planned on the profile the GPU was bound to,
# with the profile's figures and with the measured ones.
PROFILE=$(sed -n 's/^  "profile": "\(.*\)",$/\1/p' "$W/calibrate.json")
if [ -n "$PROFILE" ]; then
    printf 'model: gpt2\nhardware: %s\nseq_len: 1024\nglobal_batch: 16\ngrid:\n  micro_batch: [16]\n  precision: [bf16]\n  attention: [fused]\n  optimizer: [adamw]\n  gpus: [1]\n' \
        "$PROFILE" >"$W/gpt2-calibrated.yaml"
    for M in 1 ""; do
        log "plan of GPT-2 124M on $PROFILE, MEMFIT_NO_GPU_CALIBRATION=$M"
        MEMFIT_NO_GPU_CALIBRATION=$M timeout 60 "$BIN" plan "$W/gpt2-calibrated.yaml" 2>&1 \
            | tr -s ' \n' ' ' | grep -o 'step [0-9.]* s = compute [^)]*)' | tee -a "$W/summary.txt"
    done
else
    log "no hardware profile matched this GPU: no plan uses the calibration"
fi
unset MEMFIT_CACHE_DIR

for ATTN in eager fused; do
    log "GPT-2 124M bf16 B=16 T=1024 $ATTN attention (memfit, cuda)"
    timeout 150 "$BIN" run --model gpt2 --device cuda --precision bf16 --micro-batch 16 --seq-len 1024 \
        --attention "$ATTN" --optimizer adamw --steps 12 --format json \
        >"$W/gpt2-memfit-$ATTN.json" 2>"$W/gpt2-memfit-$ATTN.err"
    echo "exit $?" >>"$W/gpt2-memfit-$ATTN.err"
done

log "NVML per-process peak against the tracked peak (gpt2 bf16, a one-trial sweep)"
cat >"$W/nvml-check.yaml" <<'YAML'
model: gpt2
hardware: h200-141gb
device: cuda
seq_len: 1024
global_batch: 16
grid:
  micro_batch: [16]
  precision: [bf16]
  checkpointing: [none]
  attention: [fused]
  optimizer: [adamw]
  sharding: [none]
  gpus: [1]
YAML
timeout 150 "$BIN" sweep "$W/nvml-check.yaml" --out "$W/nvml-sweep" --exhaustive --steps 3 --max-steps 5 \
    >"$W/nvml-sweep.log" 2>&1
echo "exit $?" >>"$W/nvml-sweep.log"

TORCH=none
if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    log "GPT-2 124M bf16 B=16 T=1024 (PyTorch eager)"
    timeout 180 python3 scripts/torch_gpt2_step.py --batch 16 --seq 1024 --steps 12 >"$W/gpt2-torch.json" 2>"$W/gpt2-torch.err"
    TORCH=ran
    if python3 -c "import transformers" 2>/dev/null; then
        log "hf-eager against torch.cuda.max_memory_allocated/reserved (Hugging Face models, step 2)"
        MEMFIT_BIN="$BIN" timeout 240 python3 scripts/torch_hf_memory.py >"$W/hf-memory.json" 2>"$W/hf-memory.err"
        echo "exit $?" >>"$W/hf-memory.err"
        tail -n 7 "$W/hf-memory.err" | tee -a "$W/summary.txt"
    else
        log "transformers is not importable here: no hf-eager check on the GPU"
    fi
else
    log "PyTorch with CUDA is not importable here: no side-by-side"
fi

log "memfit launch on the GPU: NCCL world of one (ddp), then 2 ranks zero2 staged through the host"
LAUNCH_ARGS="--model llama-tiny --device cuda:0 --steps 3 --format json"
timeout 120 "$BIN" launch --nproc 1 -- run $LAUNCH_ARGS --ranks 1 --sharding ddp \
    >"$W/launch-nccl-1.json" 2>"$W/launch-nccl-1.err"
echo "exit $?" >>"$W/launch-nccl-1.err"
timeout 120 "$BIN" run $LAUNCH_ARGS --ranks 1 --sharding ddp >"$W/threads-ddp-1.json" 2>/dev/null
MEMFIT_DIST_BACKEND=tcp timeout 120 "$BIN" launch --nproc 2 -- run $LAUNCH_ARGS --ranks 2 --sharding zero2 \
    >"$W/launch-tcp-2.json" 2>"$W/launch-tcp-2.err"
echo "exit $?" >>"$W/launch-tcp-2.err"
timeout 120 "$BIN" run $LAUNCH_ARGS --ranks 2 --sharding zero2 >"$W/threads-zero2-2.json" 2>/dev/null
MEMFIT_DIST_BACKEND=tcp timeout 120 "$BIN" launch --nproc 2 -- run $LAUNCH_ARGS --ranks 2 --tensor-parallel 2 \
    >"$W/launch-tcp-tp2.json" 2>"$W/launch-tcp-tp2.err"
echo "exit $?" >>"$W/launch-tcp-tp2.err"
timeout 120 "$BIN" run $LAUNCH_ARGS --ranks 2 --tensor-parallel 2 >"$W/threads-tp2.json" 2>/dev/null
python3 - "$W" <<'PY' 2>&1 | tee -a "$W/summary.txt"
import json, sys
out = sys.argv[1]
for launched, threaded in (("launch-nccl-1", "threads-ddp-1"), ("launch-tcp-2", "threads-zero2-2"),
                           ("launch-tcp-tp2", "threads-tp2")):
    try:
        a, b = (json.load(open(f"{out}/{n}.json")) for n in (launched, threaded))
        same_loss = [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
        same_peaks = [r["peak_bytes"] for r in a["ranks"]] == [r["peak_bytes"] for r in b["ranks"]]
        print(f"{launched}: losses as threads {same_loss}, per-rank peaks as threads {same_peaks}")
    except Exception as e:
        print(f"{launched}: no report ({e}); see {out}/{launched}.err")
PY

python3 - "$W" "$TORCH" <<'PY' 2>&1 | tee -a "$W/summary.txt"
import json, sys, statistics
out, torch = sys.argv[1], sys.argv[2]
# Dense bf16 tensor-core peaks (NVIDIA datasheets): H100/H200 SXM 989.4 TFLOP/s,
# A100 312 TFLOP/s.
PEAKS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
import subprocess
name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout
peak = next((v for k, v in PEAKS.items() if k in name), None)
res = {"gpu": name.strip()}
best = None
for attn in ("eager", "fused"):
    try:
        m = json.load(open(f"{out}/gpt2-memfit-{attn}.json"))
        steps = m["steps"][1:]  # the first step warms up
        med_ms = statistics.median(s["ms"] for s in steps)
    except Exception as e:
        res[f"{attn}_error"] = f"no report: {e}"
        continue
    tok = m["tokens_per_step"] / (med_ms / 1e3)
    res[f"{attn}_tokens_per_s"] = tok
    res[f"{attn}_step_ms"] = med_ms
    res[f"{attn}_peak_tracked_bytes"] = m["peak_bytes"]["total"]
    res[f"{attn}_loss_last"] = m["steps"][-1]["loss"]
    if peak:
        res[f"{attn}_mfu"] = m["flops_per_step"] / (med_ms / 1e3) / peak
    best = max(best or 0.0, tok)
if torch == "ran":
    try:
        t = json.load(open(f"{out}/gpt2-torch.json"))
        res["torch_tokens_per_s"] = t["tokens_per_s"]
        res["torch_peak_allocated_bytes"] = t["max_memory_allocated"]
        if best:
            res["memfit_best_over_torch"] = best / t["tokens_per_s"]
    except Exception as e:
        res["torch_error"] = str(e)
# NVML's per-process peak must lie within the tracked peak + 5% + the
# measured start-up overhead (context, module, cuBLAS): the issue's check.
try:
    rep = json.load(open(f"{out}/nvml-sweep/report.json"))
    t = rep["trials"][0]
    tracked = t["measured"]["peak_bytes"]["total"]
    overhead = rep["runtime_overhead_bytes"]
    nv = t["measured"].get("nvml_peak_bytes")
    res["nvml_state"] = rep.get("nvml")
    res["nvml_peak_bytes"] = nv
    res["nvml_tracked_bytes"] = tracked
    res["nvml_overhead_bytes"] = overhead
    res["nvml_within_5pct_plus_overhead"] = nv is not None and tracked <= nv <= tracked * 1.05 + overhead
except Exception as e:
    res["nvml_error"] = f"no NVML sweep report: {e}"
json.dump(res, open(f"{out}/gpu-check.json", "w"), indent=2)
for k, v in res.items():
    print(f"{k:28} {v:.4g}" if isinstance(v, float) else f"{k:28} {v}")
PY
exit $SELFTEST_RC
