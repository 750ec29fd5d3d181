#!/usr/bin/env python3
"""Independent reference for memfit's cpu Adafactor kernel (src/backend/cpu_optim.rs).

Writes tests/fixtures/optim/adafactor.json, read by the Rust test
`cpu_optim::tests::adafactor_matches_reference`. Plain Python floats (f64), no
dependencies: run `python3 tests/reference/adafactor_reference.py` from the repo
root to regenerate.

The algorithm is Adafactor (Shazeer & Stern, 2018) as Hugging Face
`transformers.optimization.Adafactor` runs it, written here from its
description (memfit's `AdafactorHyper` doc plus HF's documented behaviour),
one step t = 1, 2, 3, ...:

    g       = grad * grad_scale
    lr_t    = lr if lr is given else min(1e-2, 1/sqrt(t))        (relative step)
    lr_t   *= max(eps2, RMS(param))    if scale_parameter, RMS of the param
                                       before this step, with or without lr
    beta2_t = 1 - t**decay_rate
    u       = g**2 + eps1
    factored (rows x cols, row-major):
        row[i] = beta2_t*row[i] + (1-beta2_t)*mean_j u[i,j]
        col[j] = beta2_t*col[j] + (1-beta2_t)*mean_i u[i,j]
        upd[i,j] = g[i,j] / sqrt(row[i]/mean(row) * col[j])   (new row/col)
    full:
        v = beta2_t*v + (1-beta2_t)*u;  upd = g / sqrt(v)
    upd    /= max(1, RMS(upd)/clip_threshold)
    upd    *= lr_t                      (HF scales by lr before the momentum)
    beta1:  m = beta1*m + (1-beta1)*upd;  upd = m
    param  -= weight_decay*lr_t*param   (when weight_decay != 0)
    param  -= upd

RMS(x) = sqrt(mean(x**2)). Inputs are dyadic rationals, exact in f32, so the
Rust kernel (f32 with f64 reductions) starts from the same numbers; hyper-
parameters are rounded to f32 here for the same reason.
"""

import json
import math
import os
import random
import struct


def f32(x):
    """Round a Python float to the nearest f32 (what the Rust side stores)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def rms(xs):
    return math.sqrt(sum(x * x for x in xs) / len(xs))


def mean(xs):
    return sum(xs) / len(xs)


def adafactor_step(t, p, grad, st, hp):
    """One step in place on lists: p (n), st = {row, col} or {v}, plus {m}."""
    n = len(p)
    g = [x * hp["grad_scale"] for x in grad]
    if hp["lr"] is None:
        lr_t = min(1e-2, 1.0 / math.sqrt(t))
    else:
        lr_t = hp["lr"]
    if hp["scale_parameter"]:
        lr_t *= max(hp["eps2"], rms(p))
    beta2_t = 1.0 - t ** hp["decay_rate"]
    u = [x * x + hp["eps1"] for x in g]
    if "row" in st:
        rows, cols = hp["shape"]
        row, col = st["row"], st["col"]
        for i in range(rows):
            row[i] = beta2_t * row[i] + (1 - beta2_t) * mean(u[i * cols:(i + 1) * cols])
        for j in range(cols):
            col[j] = beta2_t * col[j] + (1 - beta2_t) * mean(u[j::cols])
        rm = mean(row)
        upd = [g[i * cols + j] / math.sqrt(row[i] / rm * col[j])
               for i in range(rows) for j in range(cols)]
    else:
        v = st["v"]
        for k in range(n):
            v[k] = beta2_t * v[k] + (1 - beta2_t) * u[k]
        upd = [g[k] / math.sqrt(v[k]) for k in range(n)]
    clip = max(1.0, rms(upd) / hp["clip_threshold"])
    upd = [x / clip * lr_t for x in upd]
    if hp["beta1"] is not None:
        m = st["m"]
        for k in range(n):
            m[k] = hp["beta1"] * m[k] + (1 - hp["beta1"]) * upd[k]
        upd = list(m)
    if hp["weight_decay"] != 0:
        for k in range(n):
            p[k] -= hp["weight_decay"] * lr_t * p[k]
    for k in range(n):
        p[k] -= upd[k]


def make_case(rng, name, shape, lr, beta1, weight_decay=0.0, grad_scale=1.0,
              scale_parameter=True, clip_threshold=1.0, steps=3):
    n = 1
    for d in shape:
        n *= d
    # params: random sign, magnitude in [0.5, 1.5) (no near-zero entries, so a
    # relative comparison is meaningful); grads in (-2, 2); all k/1024, exact in f32
    param0 = [rng.choice((-1, 1)) * rng.randrange(512, 1536) / 1024 for _ in range(n)]
    grads = [[rng.randrange(-2047, 2048) / 1024 for _ in range(n)] for _ in range(steps)]
    hp = {
        "shape": shape,
        "lr": None if lr is None else f32(lr),
        "beta1": None if beta1 is None else f32(beta1),
        "decay_rate": f32(-0.8),
        "eps1": f32(1e-30),
        "eps2": f32(1e-3),
        "clip_threshold": f32(clip_threshold),
        "weight_decay": f32(weight_decay),
        "scale_parameter": scale_parameter,
        "grad_scale": f32(grad_scale),
    }
    p = list(param0)
    if len(shape) == 2:
        st = {"row": [0.0] * shape[0], "col": [0.0] * shape[1]}
    else:
        st = {"v": [0.0] * n}
    if beta1 is not None:
        st["m"] = [0.0] * n
    expected = []
    for t in range(1, steps + 1):
        adafactor_step(t, p, grads[t - 1], st, hp)
        snap = {"param": list(p)}
        snap.update({k: list(v) for k, v in st.items()})
        expected.append(snap)
    case = {"name": name, "param0": param0, "grads": grads, "expected": expected}
    case.update(hp)
    return case


def main():
    rng = random.Random(20240607)
    cases = []
    for shape in ([5, 7], [9]):
        kind = "factored" if len(shape) == 2 else "full"
        for beta1 in (None, 0.9):
            for lr in (None, 3e-2):
                name = f"{kind}_{'beta1' if beta1 else 'nobeta1'}_{'lr' if lr else 'relstep'}"
                # vary the rest so each path is covered somewhere
                wd = 0.1 if beta1 is not None else 0.0
                gs = 0.5 if lr is not None else 1.0
                cases.append(make_case(rng, name, shape, lr, beta1, weight_decay=wd, grad_scale=gs))
    # no parameter scaling, explicit lr, a tight clip that always triggers
    cases.append(make_case(rng, "factored_noscale_clip", [4, 6], 1e-2, None,
                           scale_parameter=False, clip_threshold=0.5))
    cases.append(make_case(rng, "full_noscale_clip_beta1", [9], 1e-2, 0.8,
                           scale_parameter=False, clip_threshold=0.5))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = os.path.join(root, "tests", "fixtures", "optim", "adafactor.json")
    with open(out, "w") as f:
        json.dump({"generator": "tests/reference/adafactor_reference.py", "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
