"""What torch.compile's graph of torchtune's chunked loss holds, for memfit's
`--compile-loss` (src/engine/framework.rs, `Step::compiled_loss`).

torchtune's `compile: True` compiles `LinearCrossEntropyLoss.compute_cross_entropy`
(torchtune/modules/loss/cross_entropy_loss.py @ bd2a0fc): a part's hidden rows
projected by the frozen head, upcast and reduced by cross-entropy. This runs
that function on the cpu, eager and compiled, in bf16 and fp32, and records:

- what autograd saves for the backward (saved_tensors_hooks), by row, leaving
  out the head's weight (a parameter), the targets and scalars;
- the buffers the compiled forward and backward allocate (inductor's generated
  code, `empty_strided_cpu`), and whether the backward writes the logits'
  gradient into the saved projection output (`buf = mm; del mm  # reuse`).

Inductor's partitioner and buffer reuse do not depend on the device, so the
graphs are the ones a GPU runs; the kernels differ, the tensors do not.

    ~/.venvs/hfref/bin/python tests/reference/compiled_loss.py

writes tests/reference/compiled_loss.json, which tests/it/compiled_loss.rs
reads.
"""

import json
import pathlib
import re

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

ROWS, VOCAB, WIDTH = 96, 1000, 64
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def loss_fn(weight):
    # torchtune's compute_cross_entropy, the projection passed in.
    def compute_cross_entropy(hidden_chunk, target_chunk):
        logits = F.linear(hidden_chunk, weight)
        return F.cross_entropy(logits.float(), target_chunk, reduction="sum")

    return compute_cross_entropy


def ce_only(logits_chunk, target_chunk):
    # CEWithChunkedOutputLoss.compute_cross_entropy (torchtune @ 30b8519,
    # modules/loss/ce_chunked_output_loss.py), which training.compile_loss
    # compiles alone there: the model made the chunk's logits in eager.
    return F.cross_entropy(logits_chunk.float(), target_chunk, reduction="sum")


def saved_per_row(fn, hidden, targets, weight):
    seen = {}

    def pack(x):
        if x.data_ptr() != weight.data_ptr() and x.dtype != torch.int64 and x.dim() > 0:
            seen[(x.data_ptr(), x.dtype)] = x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = fn(hidden, targets)
    loss.backward()
    return sum(seen.values()) / ROWS


BUFFER = re.compile(r"(buf\d+) = empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")


def buffers(code):
    out = []
    for name, shape, dtype in BUFFER.findall(code):
        dims = [int(d) for d in shape.split(",") if d.strip()]
        out.append({"shape": dims, "dtype": dtype})
    return out


def main():
    torch.manual_seed(0)
    cases = []
    for name, dt in DTYPES.items():
        weight = torch.randn(VOCAB, WIDTH, dtype=dt)
        targets = torch.randint(0, VOCAB, (ROWS,))
        fn = loss_fn(weight)
        eager = saved_per_row(fn, torch.randn(ROWS, WIDTH, dtype=dt, requires_grad=True), targets, weight)
        cases.append({"dtype": name, "mode": "eager", "saved_per_row_bytes": eager})
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        compiled_saved = saved_per_row(
            compiled, torch.randn(ROWS, WIDTH, dtype=dt, requires_grad=True), targets, weight
        )
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        hidden = torch.randn(ROWS, WIDTH, dtype=dt, requires_grad=True)
        _, codes = run_and_get_code(lambda: compiled(hidden, targets).backward())
        assert len(codes) == 2, f"a forward and a backward graph, not {len(codes)}"
        forward, backward = codes
        cases.append(
            {
                "dtype": name,
                "mode": "compiled",
                "saved_per_row_bytes": compiled_saved,
                "forward_buffers": buffers(forward),
                "backward_buffers": buffers(backward),
                "backward_reuses_saved_logits": bool(re.search(r"= mm; del mm\s+# reuse", backward)),
            }
        )
    # torchtune @ 30b8519's compiled loss: the upcast and cross-entropy
    # alone, the logits chunk an input of the graph (bf16).
    torch._dynamo.reset()
    logits = torch.randn(ROWS, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, VOCAB, (ROWS,))
    compiled = torch.compile(ce_only)
    _, codes = run_and_get_code(lambda: compiled(logits, targets).backward())
    forward, backward = codes
    cases.append(
        {
            "dtype": "bf16",
            "mode": "compiled-ce-only",
            "saved_per_row_bytes": saved_per_row(
                torch.compile(ce_only), torch.randn(ROWS, VOCAB, dtype=torch.bfloat16, requires_grad=True), targets, torch.empty(0)
            ),
            "forward_buffers": buffers(forward),
            "backward_buffers": buffers(backward),
            "backward_reuses_saved_logits": bool(re.search(r"# reuse", backward)),
        }
    )
    out = {
        "source": "tests/reference/compiled_loss.py",
        "torch": torch.__version__,
        "rows": ROWS,
        "vocab": VOCAB,
        "width": WIDTH,
        "cases": cases,
    }
    path = pathlib.Path(__file__).with_name("compiled_loss.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
