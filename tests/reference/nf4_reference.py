#!/usr/bin/env python3
"""Independent reference for memfit's NF4 storage (src/nf4.rs).

Writes tests/fixtures/quant/nf4.json, read by tests/nf4.rs. Plain Python 3, no
third-party packages: run `python3 tests/reference/nf4_reference.py` from the
repo root to regenerate (deterministic: the inputs come from a SplitMix64
generator written below, seeded per case).

Written from the description in Dettmers et al., "QLoRA: Efficient Finetuning
of Quantized LLMs" (2023), section 3:

  * NormalFloat (NF4): 16 values at quantiles of N(0, 1), normalised to
    [-1, 1], with an exact zero; the values are the ones in Appendix E (the
    same table as bitsandbytes' NF4). `check_table` recomputes them from the
    quantile construction with statistics.NormalDist (agrees within 2e-7).
  * Block-wise absmax quantisation, blocks of 64: c = absmax(block),
    code = the NF4 value nearest to x / c (ties go to the lower value; an
    all-zero block, c = 0, gets the code of 0.0).
  * Double quantisation: the fp32 absmax values c2, minus their mean over the
    whole tensor, quantised to 8 bits in blocks of 256. The paper (and
    bitsandbytes) use an 8-bit float code here; memfit uses a symmetric linear
    int8 code instead: scale = max|c2 - mean| / 127 per 256-block,
    q = round_half_away((c2 - mean) / scale), c2' = q * scale + mean.
    Only the sizes (8 bits per block, fp32 per 256 blocks) are what the paper
    counts (0.127 bits per parameter beyond the 4).
  * Dequantisation: x' = NF4[code] * c2'.

Every operation is rounded to float32 (struct round trip) after each step, as
the Rust side computes in f32, so the codes must agree exactly; the mean is
summed in f64, in order, divided in f64, then rounded to f32, like the Rust.

Fixture: {"nf4", "block", "absmax_block", "cases": [{"name", "n", "x",
"codes" (one 0..15 per element), "absmax" (per 64-block, exact fp32),
"absmax_codes" (-127..127 per 64-block), "absmax_scales" (per 256 absmax),
"absmax_mean", "absmax_dequant" (per 64-block), "dequant" (per element),
"storage_bytes"}]}. Floats are written in the shortest decimal that reads back
(decimal -> f64 -> f32) to the same float32.
"""

import json
import math
import os
import struct
from statistics import NormalDist

BLOCK = 64
ABSMAX_BLOCK = 256

# QLoRA Appendix E / bitsandbytes' NF4 table (all exact float32 values).
NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]


def f32(x):
    """Round a Python float to the nearest float32."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def check_table():
    """NF4 from its construction (QLoRA section 3 / Appendix E): 8 positive
    quantiles of N(0,1) at probabilities evenly spaced from `offset` down to
    0.5 (exclusive), 7 negative ones likewise, and 0, divided by the largest.
    offset = 0.9677083 is bitsandbytes' choice, (1 - 1/(2*15) + 1 - 1/(2*16))/2."""
    offset = 0.9677083
    ppf = NormalDist().inv_cdf

    def spaced(n):
        return [offset + (0.5 - offset) * i / (n - 1) for i in range(n - 1)]

    pos = [ppf(p) for p in spaced(9)]
    neg = [-ppf(p) for p in spaced(8)]
    vals = sorted(pos + neg + [0.0])
    top = max(vals)
    vals = [v / top for v in vals]
    err = max(abs(a - b) for a, b in zip(vals, NF4))
    assert err < 2e-7, f"NF4 table differs from its construction by {err}"
    assert all(f32(v) == v for v in NF4)


def nearest_code(v):
    """Index of the NF4 value nearest to v; at an exact midpoint, the lower."""
    count = 0
    for i in range(15):
        mid = f32(f32(NF4[i] + NF4[i + 1]) * 0.5)
        if v > mid:
            count += 1
    return count


def round_half_away(t):
    r = math.floor(abs(t) + 0.5)  # exact: |t| <= ~127, a float32
    return -r if t < 0 else r


def quantize(x):
    n = len(x)
    blocks = [x[i:i + BLOCK] for i in range(0, n, BLOCK)]
    absmax = [max(abs(v) for v in b) for b in blocks]
    codes = []
    for b, c in zip(blocks, absmax):
        for v in b:
            codes.append(nearest_code(f32(v / c)) if c > 0 else NF4.index(0.0))
    # double quantisation (QLoRA section 3): subtract the mean, then 8-bit
    # blockwise over 256 absmax values
    s = 0.0
    for c in absmax:
        s += c
    mean = f32(s / len(absmax)) if absmax else 0.0
    centred = [f32(c - mean) for c in absmax]
    qcodes, scales, deq_absmax = [], [], []
    for g in range(0, len(centred), ABSMAX_BLOCK):
        group = centred[g:g + ABSMAX_BLOCK]
        scale = f32(max(abs(d) for d in group) / 127.0)
        scales.append(scale)
        for d in group:
            q = 0 if scale == 0 else max(-127, min(127, round_half_away(f32(d / scale))))
            qcodes.append(q)
            deq_absmax.append(f32(f32(q * scale) + mean))
    dequant = [f32(NF4[k] * deq_absmax[i // BLOCK]) for i, k in enumerate(codes)]
    nblocks = len(blocks)
    storage = (n + 1) // 2 + nblocks + 4 * len(scales) + 4
    return {
        "codes": codes, "absmax": absmax, "absmax_codes": qcodes,
        "absmax_scales": scales, "absmax_mean": mean,
        "absmax_dequant": deq_absmax, "dequant": dequant, "storage_bytes": storage,
    }


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & (2**64 - 1)

    def next_u64(self):
        m = 2**64 - 1
        self.state = (self.state + 0x9E3779B97F4A7C15) & m
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    def uniform(self):
        return (self.next_u64() >> 11) / 2.0**53

    def below(self, n):
        return (self.next_u64() * n) >> 64

    def normal(self):
        u1 = max(self.uniform(), 2.0**-1022)
        u2 = self.uniform()
        return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def short(v):
    """The shortest decimal (as a float) that reads back, via f64, to the float32 v
    (+0.0 as the int 0, to keep the json small)."""
    if v == 0 and math.copysign(1.0, v) > 0:
        return 0
    for p in range(1, 10):
        d = float("%.*g" % (p, v))
        if f32(d) == v:
            return d
    raise AssertionError(v)


def dec3(v):
    """v to 3 significant digits, then float32 (short inputs in the json)."""
    return f32(float("%.3g" % v))


def case_one_block():
    r = SplitMix64(1)
    return [f32(0.02 * r.normal()) for _ in range(64)]


def case_partial_last_block():
    # 16 blocks, the last of 40; block scales log-uniform over 1e-3 .. 1
    r = SplitMix64(2)
    x = []
    for i in range(1000):
        if i % BLOCK == 0:
            sigma = 10.0 ** (-3.0 * r.uniform())
        x.append(f32(sigma * r.normal()))
    return x


def case_zero_block_outliers():
    # 5 blocks (the last of 44): block 2 all zero; outliers of 8-30 sigma in
    # blocks 0 and 3; the last block has absmax exactly 1 and values on the
    # midpoints between NF4 values (exact ties), a -0.0 and a 0.0
    r = SplitMix64(3)
    x = [f32(0.05 * r.normal()) for _ in range(300)]
    for i in range(128, 192):
        x[i] = 0.0
    for i in (5, 40, 200, 201, 250):
        x[i] = f32(0.05 * (8.0 + 22.0 * r.uniform()) * (1 if r.below(2) else -1))
    tail = 256
    x[tail] = 1.0
    for k in range(15):
        x[tail + 1 + k] = f32(f32(NF4[k] + NF4[k + 1]) * 0.5)
    x[tail + 16] = -0.0
    x[tail + 17] = 0.0
    for i in range(tail + 18, 300):
        x[i] = f32(max(-0.99, min(0.99, x[i] * 10)))
    return x


def case_two_absmax_groups():
    # 258 blocks (the last of 22): two 256-groups of absmax values, the second
    # with 2. Sparse to keep the json small: 5 nonzero values per block at
    # 3 significant digits, block scales log-uniform over 1e-2 .. 1; block 100
    # is all zero, block 200 has a single nonzero value
    r = SplitMix64(4)
    n = 257 * BLOCK + 22
    x = [0.0] * n
    for b in range(0, n, BLOCK):
        width = min(BLOCK, n - b)
        sigma = 10.0 ** (-2.0 * r.uniform())
        for _ in range(5):
            x[b + r.below(width)] = dec3(sigma * r.normal())
    for i in range(100 * BLOCK, 101 * BLOCK):
        x[i] = 0.0
    for i in range(200 * BLOCK, 201 * BLOCK):
        x[i] = 0.0
    x[200 * BLOCK + 7] = -0.5
    return x


def main():
    check_table()
    cases = []
    for name, gen in (
        ("one_block", case_one_block),
        ("partial_last_block", case_partial_last_block),
        ("zero_block_outliers", case_zero_block_outliers),
        ("two_absmax_groups", case_two_absmax_groups),
    ):
        x = gen()
        assert all(f32(v) == v and math.isfinite(v) for v in x)
        q = quantize(x)
        case = {"name": name, "n": len(x), "x": [short(v) for v in x]}
        for k, v in q.items():
            if k in ("codes", "absmax_codes", "storage_bytes"):
                case[k] = v
            elif isinstance(v, list):
                case[k] = [short(t) for t in v]
            else:
                case[k] = short(v)
        cases.append(case)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = os.path.join(root, "tests", "fixtures", "quant", "nf4.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    compact = dict(separators=(",", ":"))
    with open(out, "w") as f:
        f.write('{"generator":"tests/reference/nf4_reference.py",\n')
        f.write(f'"block":{BLOCK},"absmax_block":{ABSMAX_BLOCK},\n')
        f.write('"nf4":' + json.dumps(NF4, **compact) + ',\n"cases":[\n')
        for i, c in enumerate(cases):
            items = [json.dumps(k) + ":" + json.dumps(v, **compact) for k, v in c.items()]
            f.write("{" + ",\n".join(items) + "}" + (",\n" if i + 1 < len(cases) else "\n"))
        f.write("]}\n")
    print(f"wrote {len(cases)} cases ({sum(c['n'] for c in cases)} values) to {out}")


if __name__ == "__main__":
    main()
