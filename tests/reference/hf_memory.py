#!/usr/bin/env python3
"""Reference memory fixtures for a future `hf-eager` framework profile.

Measures what PyTorch + Hugging Face transformers allocate in ONE steady-state
training step (the second step, so AdamW's state exists) of GPT2LMHeadModel and
LlamaForCausalLM, split into memfit's categories, without allocating real
memory: every tensor is a fake cpu tensor (torch._subclasses.fake_tensor.
FakeTensorMode) and PyTorch's module-level tracker
torch.distributed._tools.mem_tracker.MemTracker counts the bytes of every
storage that is alive, by category, after every aten op.

Run by hand (not in CI), from the repository root:

    python3 -m venv .venv-hfref
    .venv-hfref/bin/pip install -r tests/reference/requirements.txt
    .venv-hfref/bin/python tests/reference/hf_memory.py            # all configs
    .venv-hfref/bin/python tests/reference/hf_memory.py --only gpt2-t64   # a subset (substring match)
    .venv-hfref/bin/python tests/reference/hf_memory.py --list

It writes tests/reference/hf_memory.json (or --out PATH) and prints a table.
See tests/reference/README.md for what is measured and the category mapping.

The tracked step is the loop most training scripts write:

    with autocast (bf16-autocast only):
        loss = model(input_ids=x, labels=x).loss   # HF shifts the labels itself
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=...)

(the ModelOutput, and with it the logits, is dropped as soon as `.loss` is
read, as in that loop). Step 1 runs untracked first; the tracker is then given
the model, the optimizer (its state) and the input tensor with
`track_external`, and step 2 is tracked.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import sys
import time
import warnings

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
import transformers.masking_utils as _masking_utils

# A real run with no attention mask and plain positions lets sdpa use its
# `is_causal` path: transformers builds no 4D mask and (llama) calls sdpa with
# `enable_gqa` instead of `repeat_kv`. Under FakeTensorMode the position ids
# cannot be read, so `find_packed_sequence_indices` (masking_utils.py) cannot
# rule out packed sequences and returns a mask; the causal-mask skip is then
# refused and every sdpa layer would save a (B,1,T,T) float mask (plus, for
# llama, repeated k/v) that a real run never allocates. Our inputs are never
# packed (position ids are the default arange), so answer as a real run does.
_masking_utils.find_packed_sequence_indices = lambda position_ids: None

MIB = 1024 * 1024

# MemTracker's categories (its _MemRefType) -> memfit's category names.
CATEGORY_MAP = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries",
    _MemRefType.BUFFER: "buffers",
    _MemRefType.OTH: "other",  # tensors given to track_external: the input ids
}
CATEGORIES = [
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "temporaries",
    "buffers",
    "other",
]
TOTAL_KEY = "Total"  # MemTracker's _TOTAL_KEY

# ---------------------------------------------------------------- models ----

# Dimensions from profiles/models/gpt2.yaml and profiles/models/llama-3.2-1b.yaml.
# Hugging Face does not pad the vocabulary (memfit's gpt2 profile pads 50257 to
# 50304 with pad_vocab_to: 64); these are the unpadded HF shapes.
MODELS = {
    "gpt2": dict(
        family="gpt2",
        hf=dict(
            vocab_size=50257,
            n_positions=1024,
            n_embd=768,
            n_layer=12,
            n_head=12,
            n_inner=None,  # 4 * n_embd = 3072
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            use_cache=False,
        ),
    ),
    "llama-3.2-1b": dict(
        family="llama",
        hf=dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=True,
            hidden_act="silu",
            use_cache=False,
        ),
    ),
}
# A 4-layer model of llama-3.2-1b's width: cheaper, and the difference against
# the 16-layer one isolates the per-layer cost.
MODELS["llama-1b-4l"] = dict(
    family="llama", hf=dict(MODELS["llama-3.2-1b"]["hf"], num_hidden_layers=4)
)
# Untied heads, which no model above has: TinyLlama-1.1B's dimensions
# (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json) with 4 of
# its 22 layers, and Qwen2.5-7B's (Qwen/Qwen2.5-7B config.json: q/k/v biases,
# a 152k vocabulary) with 2 of its 28. `model_type` lets memfit import them as
# it imports a config.json.
MODELS["tinyllama-4l"] = dict(
    family="llama",
    hf=dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        hidden_act="silu",
        use_cache=False,
    ),
)
# Phi-3-mini's dimensions (microsoft/Phi-3-mini-4k-instruct config.json:
# fused qkv_proj and gate_up_proj, untied) with 2 of its 32 layers.
MODELS["phi3-mini-2l"] = dict(
    family="phi3",
    hf=dict(
        model_type="phi3",
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        hidden_act="silu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        use_cache=False,
    ),
)
# Issue 30's new families, each with a few of its layers. Qwen3-0.6B
# (Qwen/Qwen3-0.6B config.json): q and k normalised per head, heads of 128
# on a 1024-wide stream (16 x 128 = 2048 != 1024), tied. Mixtral-8x7B
# (mistralai/Mixtral-8x7B-v0.1 config.json): 8 experts, 2 per token.
# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 128 experts, 8 per token,
# renormalised, with Qwen3's q/k norms and 128-wide heads on a 2048-wide
# stream. OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924 config.json): 64 experts, 8
# per token, not renormalised, q and k normalised over their full width.
# The experts run as transformers builds them by default
# (`config._experts_implementation` "grouped_mm": the tokens sorted by
# expert and two grouped GEMMs, shapes fixed by N x top_k, whatever the
# routing); the fixture records the implementation it ran.
MODELS["qwen3-0.6b-4l"] = dict(
    family="qwen3",
    hf=dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        hidden_act="silu",
        use_cache=False,
    ),
)
MODELS["mixtral-8x7b-2l"] = dict(
    family="mixtral",
    hf=dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        hidden_act="silu",
        router_aux_loss_coef=0.02,
        use_cache=False,
    ),
)
MODELS["qwen3-30b-a3b-2l"] = dict(
    family="qwen3_moe",
    hf=dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        hidden_act="silu",
        router_aux_loss_coef=0.001,
        use_cache=False,
    ),
)
MODELS["olmoe-1b-7b-2l"] = dict(
    family="olmoe",
    hf=dict(
        model_type="olmoe",
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        hidden_act="silu",
        router_aux_loss_coef=0.01,
        use_cache=False,
    ),
)
MODELS["qwen2.5-7b-2l"] = dict(
    family="qwen2",
    hf=dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=2,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        hidden_act="silu",
        use_cache=False,
    ),
)

# Gemma 2 and Gemma 3 (text), a few of their layers: sandwich norms,
# (1 + w) RMSNorms in fp32, GeGLU, the embedding scaled by sqrt(C), and
# sliding windows. Gemma-2-2B (google/gemma-2-2b config.json): soft caps 50
# on the scores and 30 on the logits, 10 of its 26 layers (sliding and
# global alternate). Gemma-3-1B (google/gemma-3-1b-pt config.json):
# per-head q/k norms, two RoPE bases, a 512-token window on 5 layers of 6,
# no soft caps; 18 of its 26 layers. Enough layers that the optimizer step
# can outweigh the tied 256k-row embedding's backward (its weight's
# gradient, the head's and their sum: fewer layers and every peak is
# there). `layer_types` is written out so memfit imports the pattern.
MODELS["gemma-2-2b-10l"] = dict(
    family="gemma2",
    hf=dict(
        model_type="gemma2",
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=4096,
        layer_types=["sliding_attention", "full_attention"] * 5,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        use_cache=False,
    ),
)
MODELS["gemma-3-1b-18l"] = dict(
    family="gemma3_text",
    hf=dict(
        model_type="gemma3_text",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        tie_word_embeddings=True,
        use_cache=False,
    ),
)


# Families built like Llama (attention_dropout is their dropout knob).
LLAMA_LIKE = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}


def build_model(model_name, dropout, attention):
    spec = MODELS[model_name]
    hf = dict(spec["hf"])
    if spec["family"] == "gpt2":
        hf.update(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        config = transformers.GPT2Config(**hf)
        cls = transformers.GPT2LMHeadModel
    elif spec["family"] == "phi3":
        hf.update(attention_dropout=dropout)
        config = transformers.Phi3Config(**{k: v for k, v in hf.items() if k != "model_type"})
        cls = transformers.Phi3ForCausalLM
    elif spec["family"] == "qwen2":
        hf.update(attention_dropout=dropout)
        config = transformers.Qwen2Config(**{k: v for k, v in hf.items() if k != "model_type"})
        cls = transformers.Qwen2ForCausalLM
    elif spec["family"] in LLAMA_LIKE:
        hf.update(attention_dropout=dropout)
        config_cls, cls = LLAMA_LIKE[spec["family"]]
        config = config_cls(**{k: v for k, v in hf.items() if k != "model_type"})
    else:
        hf.update(attention_dropout=dropout)
        config = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
        cls = transformers.LlamaForCausalLM
    config._attn_implementation = attention
    model = cls(config)
    model.config._attn_implementation = attention
    model.train()
    return model, hf


# --------------------------------------------------------------- configs ----

BASE = dict(
    batch=4,
    seq_len=1024,
    precision="fp32",
    dropout=0.0,
    attention="eager",
    optimizer="adamw-foreach",
    set_to_none=True,
    loss="full",
    groups="one",
    checkpointing="none",
    optimizer_in_bwd=False,
)


def cfg(model, **kw):
    c = dict(BASE, model=model, family=MODELS[model]["family"])
    c.update(kw)
    short = {
        "gpt2": "gpt2",
        "llama-3.2-1b": "llama1b",
        "llama-1b-4l": "llama1b-4l",
        "tinyllama-4l": "tinyllama-4l",
        "qwen2.5-7b-2l": "qwen7b-2l",
        "phi3-mini-2l": "phi3-2l",
        "qwen3-0.6b-4l": "qwen3-0.6b-4l",
        "mixtral-8x7b-2l": "mixtral-2l",
        "qwen3-30b-a3b-2l": "qwen3moe-2l",
        "olmoe-1b-7b-2l": "olmoe-2l",
        "gemma-2-2b-10l": "gemma2-10l",
        "gemma-3-1b-18l": "gemma3-18l",
    }[model]
    name = f"{short}-b{c['batch']}-t{c['seq_len']}-{c['precision']}-d{c['dropout']:g}-{c['attention']}-{c['optimizer'].replace('adamw-', '')}"
    if not c["set_to_none"]:
        name += "-zero"
    if c["loss"] != "full":
        name += "-" + c["loss"]
    if c["groups"] != "one":
        name += "-" + c["groups"] + "groups"
    if c["checkpointing"] != "none":
        name += "-ckpt-" + c["checkpointing"]
    if c["optimizer_in_bwd"]:
        name += "-inbwd"
    c["name"] = name
    return c


def all_configs():
    """A covering design: a base (B=4, T=1024, fp32, dropout 0, eager, AdamW
    foreach, set_to_none) varied one knob at a time, plus the corners quoted
    in the issue (gpt2 T=64/1024 fp32 dropout 0, gpt2 T=1024 dropout 0.1,
    llama-3.2-1b T=1024 fp32) with both AdamW implementations."""
    out = []
    for m in ["gpt2", "llama-3.2-1b"]:
        for t in (64, 256, 1024):
            out.append(cfg(m, seq_len=t))
        out.append(cfg(m, seq_len=64, optimizer="adamw-single-tensor"))
        out.append(cfg(m, optimizer="adamw-single-tensor"))
        out.append(cfg(m, dropout=0.1))
        out.append(cfg(m, dropout=0.1, optimizer="adamw-single-tensor"))
        out.append(cfg(m, attention="sdpa"))
        out.append(cfg(m, attention="sdpa", dropout=0.1))
        out.append(cfg(m, precision="bf16-autocast"))
        out.append(cfg(m, precision="bf16-autocast", attention="sdpa"))
        out.append(cfg(m, precision="bf16-model"))
        out.append(cfg(m, precision="bf16-model", attention="sdpa"))
        out.append(cfg(m, set_to_none=False))
        out.append(cfg(m, batch=1))
    out.append(cfg("gpt2", seq_len=64, dropout=0.1))
    # The quoted figures match gradients kept resident across steps:
    # the same corners with zero_grad(set_to_none=False).
    out.append(cfg("gpt2", seq_len=64, set_to_none=False))
    out.append(cfg("gpt2", seq_len=64, set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("gpt2", dropout=0.1, set_to_none=False))
    out.append(cfg("llama-1b-4l"))
    out.append(cfg("llama-1b-4l", seq_len=256))
    # torchtune's LinearCrossEntropyLoss (the default loss of its recipes
    # since 0.6), at shapes no other config uses: each config varies one
    # knob from the first of its model.
    out.append(cfg("gpt2", batch=3, seq_len=384, loss="chunked-8"))
    out.append(cfg("gpt2", batch=3, seq_len=384, loss="chunked-4"))
    out.append(cfg("gpt2", batch=3, seq_len=384, loss="chunked-8", optimizer="adamw-single-tensor", set_to_none=False))
    out.append(cfg("gpt2", batch=3, seq_len=384, loss="chunked-8", precision="bf16-autocast", attention="sdpa"))
    out.append(cfg("llama-1b-4l", batch=2, seq_len=768, loss="chunked-8"))
    out.append(cfg("llama-1b-4l", batch=2, seq_len=768, loss="chunked-8", precision="bf16-autocast", attention="sdpa"))
    out.append(cfg("llama-1b-4l", batch=2, seq_len=768, loss="chunked-8", precision="bf16-model", attention="sdpa"))
    out.append(cfg("llama-1b-4l", batch=2, seq_len=768, loss="chunked-16", optimizer="adamw-single-tensor", set_to_none=False))
    # The gaps issue 28 names, each at shapes no other config uses, with
    # the peak in the optimizer step (foreach) and in the backward
    # (single-tensor with resident gradients):
    # untied heads with resident gradients (set_to_none=False);
    for m, b, t in (("tinyllama-4l", 2, 640), ("qwen2.5-7b-2l", 1, 448)):
        out.append(cfg(m, batch=b, seq_len=t, set_to_none=False))
        out.append(cfg(m, batch=b, seq_len=t, set_to_none=False, optimizer="adamw-single-tensor"))
        out.append(cfg(m, batch=b, seq_len=t))
    # GPT-2 with sdpa at dropout 0;
    out.append(cfg("gpt2", batch=2, seq_len=768, attention="sdpa"))
    out.append(cfg("gpt2", batch=2, seq_len=768, attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    # bf16 autocast with sdpa at odd sequence lengths.
    out.append(cfg("gpt2", batch=3, seq_len=333, precision="bf16-autocast", attention="sdpa"))
    out.append(cfg("gpt2", batch=3, seq_len=333, precision="bf16-autocast", attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("llama-1b-4l", batch=2, seq_len=501, precision="bf16-autocast", attention="sdpa"))
    out.append(cfg("llama-1b-4l", batch=2, seq_len=501, precision="bf16-autocast", attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    # Single-tensor AdamW over the Trainer's two parameter groups, whose
    # order decides which temporaries meet at the optimizer's peak.
    # Short sequences, so that the peak is the optimizer's.
    out.append(cfg("llama-1b-4l", batch=1, seq_len=48, optimizer="adamw-single-tensor", groups="hf"))
    out.append(cfg("tinyllama-4l", batch=1, seq_len=80, optimizer="adamw-single-tensor", groups="hf"))
    out.append(cfg("tinyllama-4l", batch=1, seq_len=80, optimizer="adamw-single-tensor", groups="hf", set_to_none=False))
    out.append(cfg("tinyllama-4l", batch=1, seq_len=80, groups="hf"))
    out.append(cfg("gpt2", batch=2, seq_len=40, optimizer="adamw-single-tensor", groups="hf"))
    out.append(cfg("gpt2", batch=2, seq_len=40, optimizer="adamw-single-tensor"))
    # Phi-3: fused qkv_proj and gate_up_proj (issue 30's first dense family).
    out.append(cfg("phi3-mini-2l", batch=4, seq_len=1024))
    out.append(cfg("phi3-mini-2l", batch=2, seq_len=1024, attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("phi3-mini-2l", batch=4, seq_len=1024, precision="bf16-autocast", attention="sdpa"))
    out.append(cfg("phi3-mini-2l", batch=1, seq_len=64))
    # transformers' gradient checkpointing, both torch.utils.checkpoint
    # variants, peak in the backward and in the optimizer step.
    for ck in ("non-reentrant", "reentrant"):
        out.append(cfg("gpt2", batch=4, seq_len=640, checkpointing=ck))
        out.append(cfg("llama-1b-4l", batch=2, seq_len=896, checkpointing=ck))
        out.append(cfg("tinyllama-4l", batch=1, seq_len=1152, checkpointing=ck, attention="sdpa"))
        out.append(cfg("gpt2", batch=2, seq_len=96, checkpointing=ck))
    out.append(cfg("llama-1b-4l", batch=2, seq_len=896, checkpointing="non-reentrant", precision="bf16-autocast", attention="sdpa"))
    # torchtitan's selective (per-op) checkpointing on transformers' Llama
    # (its q, k, v, o, gate, up, down are aten.mm in torchtitan's order), at
    # shapes no other config uses: the peak in the backward (single-tensor,
    # resident gradients) and in the optimizer step (foreach).
    out.append(cfg("llama-1b-4l", batch=2, seq_len=704, checkpointing="selective", attention="sdpa", optimizer="adamw-single-tensor", set_to_none=False))
    out.append(cfg("llama-1b-4l", batch=1, seq_len=192, checkpointing="selective", attention="sdpa"))
    out.append(cfg("tinyllama-4l", batch=2, seq_len=1216, checkpointing="selective", attention="sdpa", precision="bf16-autocast"))
    # Issue 30's new families (Qwen3's q/k norms and own head width;
    # experts in Mixtral, Qwen3-MoE and OLMoE), at shapes no other config
    # uses: the peak in the optimizer step (foreach, short sequences) and
    # in the backward (long ones; single-tensor with resident gradients),
    # eager and sdpa, fp32 and bf16 autocast.
    out.append(cfg("qwen3-0.6b-4l", batch=2, seq_len=576))
    out.append(cfg("qwen3-0.6b-4l", batch=1, seq_len=56))
    out.append(cfg("qwen3-0.6b-4l", batch=2, seq_len=576, attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("qwen3-0.6b-4l", batch=3, seq_len=320, precision="bf16-autocast", attention="sdpa"))
    out.append(cfg("qwen3-0.6b-4l", batch=3, seq_len=320, precision="bf16-autocast"))
    out.append(cfg("mixtral-8x7b-2l", batch=1, seq_len=200))
    out.append(cfg("mixtral-8x7b-2l", batch=2, seq_len=1536, set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("mixtral-8x7b-2l", batch=2, seq_len=1536, attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("mixtral-8x7b-2l", batch=2, seq_len=1536, precision="bf16-autocast", attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("qwen3-30b-a3b-2l", batch=1, seq_len=136))
    out.append(cfg("qwen3-30b-a3b-2l", batch=2, seq_len=704, set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("qwen3-30b-a3b-2l", batch=2, seq_len=704, precision="bf16-autocast", attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("olmoe-1b-7b-2l", batch=1, seq_len=120))
    out.append(cfg("olmoe-1b-7b-2l", batch=2, seq_len=832, set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("olmoe-1b-7b-2l", batch=2, seq_len=832, precision="bf16-autocast", attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    # Gemma 2 and Gemma 3 (text), at shapes no other config uses: the peak
    # in the optimizer step (foreach, short sequences) and in the backward
    # (single-tensor with resident gradients), eager, sdpa (Gemma 3 only:
    # Gemma 2's `_supports_sdpa` is False, its soft cap has no sdpa form),
    # fp32 and bf16 autocast. Gemma 3's 576 and 640 tokens pass its 512
    # window, so its sliding layers get their own mask.
    out.append(cfg("gemma-2-2b-10l", batch=1, seq_len=72))
    out.append(cfg("gemma-2-2b-10l", batch=2, seq_len=576, set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("gemma-2-2b-10l", batch=2, seq_len=576))
    out.append(cfg("gemma-2-2b-10l", batch=2, seq_len=576, precision="bf16-autocast", set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("gemma-3-1b-18l", batch=1, seq_len=56))
    out.append(cfg("gemma-3-1b-18l", batch=2, seq_len=640, set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("gemma-3-1b-18l", batch=2, seq_len=640, attention="sdpa", set_to_none=False, optimizer="adamw-single-tensor"))
    out.append(cfg("gemma-3-1b-18l", batch=3, seq_len=320, precision="bf16-autocast", attention="sdpa"))
    out.append(cfg("gemma-3-1b-18l", batch=3, seq_len=576, precision="bf16-autocast", set_to_none=False, optimizer="adamw-single-tensor"))
    # Pure bf16 (`bf16-model`: the module in bf16, AdamW's state bf16, no
    # master copy; torchtune's `dtype: bf16`) at shapes no other config
    # uses: an untied Llama at an odd T with single-tensor AdamW (peak in
    # the backward), Qwen3 short enough to peak in the optimizer step, and
    # GPT-2 with torchtune's chunked loss.
    out.append(cfg("tinyllama-4l", batch=1, seq_len=333, precision="bf16-model", attention="sdpa", optimizer="adamw-single-tensor"))
    out.append(cfg("qwen3-0.6b-4l", batch=1, seq_len=77, precision="bf16-model"))
    out.append(cfg("gpt2", batch=2, seq_len=500, precision="bf16-model", loss="chunked-4", optimizer="adamw-single-tensor"))
    # torchtune's optimizer in the backward (`optimizer_in_bwd`: one AdamW
    # per parameter, stepped and zero_grad'ed from its
    # register_post_accumulate_grad_hook), pure bf16 and fp32, with and
    # without torchtune's chunked loss and activation checkpointing.
    out.append(cfg("llama-1b-4l", batch=2, seq_len=384, precision="bf16-model", optimizer_in_bwd=True))
    out.append(cfg("tinyllama-4l", batch=1, seq_len=700, precision="bf16-model", attention="sdpa", loss="chunked-8", optimizer_in_bwd=True))
    out.append(cfg("gpt2", batch=2, seq_len=200, optimizer="adamw-single-tensor", optimizer_in_bwd=True))
    out.append(cfg("qwen3-0.6b-4l", batch=2, seq_len=448, precision="bf16-model", attention="sdpa", checkpointing="non-reentrant", optimizer_in_bwd=True))
    return out


def param_groups(model, groups):
    """`one`: `model.parameters()`, one group. `hf`: the two groups
    transformers' `Trainer.create_optimizer` makes: parameters that decay
    (`Trainer.get_decay_parameter_names`: none inside an `nn.LayerNorm`, and
    no name matching bias, layernorm, rmsnorm, `norm` or `_norm`) and those
    that do not (weight decay 0), each in `named_parameters()` order."""
    if groups == "one":
        return model.parameters()
    forbidden = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    in_layernorm = set()
    for mname, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm):
            for pname, _ in module.named_parameters(recurse=False):
                in_layernorm.add(f"{mname}.{pname}" if mname else pname)
    decay = [
        n
        for n, _ in model.named_parameters()
        if n not in in_layernorm and not any(re.search(f, n.lower()) for f in forbidden)
    ]
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def chunked_loss(model, x, chunks):
    """torchtune's LinearCrossEntropyLoss (torchtune/modules/loss/
    cross_entropy_loss.py), applied to a transformers model: the base model's
    hidden states split along the sequence (`tensor_split(chunks, dim=1)`),
    each chunk's valid rows selected by a boolean mask (a copy the head's
    matmul saves), projected by the head, upcast (`.float()`) and reduced by
    `F.cross_entropy(..., reduction="sum")`; the sum is divided by the valid
    tokens. Labels come shifted from torchtune's datasets: here every
    position's label is the next token (the last wraps), so every row is
    valid, as in memfit's engine."""
    base = model.transformer if hasattr(model, "transformer") else model.model
    h = base(input_ids=x).last_hidden_state
    labels = torch.roll(x, shifts=-1, dims=1)
    mask = labels != -100
    total_elements = mask.sum()
    total = 0.0
    for hc, tc in zip(h.tensor_split(chunks, dim=1), labels.tensor_split(chunks, dim=1)):
        m = tc != -100
        # `hc[m]` and `tc[m]`: fake tensors cannot index by a boolean mask
        # (its count is data), so the valid rows (all of them here) are
        # selected by their indices, as the mask's nonzero() would give them:
        # the same copies, and the same zeros + index_add in the backward.
        rows = torch.arange(m.numel())
        # The head's weight through F.linear, not the module: MemTracker's
        # module hooks refuse a module called more than once per step.
        logits = torch.nn.functional.linear(
            hc.reshape(-1, hc.shape[-1]).index_select(0, rows), model.lm_head.weight
        )
        total = total + torch.nn.functional.cross_entropy(
            logits.float(), tc.reshape(-1).index_select(0, rows), reduction="sum", ignore_index=-100
        )
        del logits
    return total / total_elements


class InBackward:
    """torchtune's optimizer in the backward (torchtune/modules/optim.py,
    `OptimizerInBackward`, pytorch/torchtune @ bd2a0fc, written out:
    torchtune itself is not installed): one optimizer per parameter, whose
    `register_post_accumulate_grad_hook` steps it and then `zero_grad()`s
    it (set_to_none, freeing the gradient); `step` and `zero_grad` of the
    loop are no-ops. The hooks are registered after the forward and
    removed after the backward: MemTracker installs its own
    post-accumulate hook (which reads `p.grad`) during the forward, and
    hooks run in registration order, so MemTracker sees each gradient
    before the step frees it, as it would with torchtune's hooks
    registered after its own."""

    def __init__(self, model, make):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizers = [make([p]) for p in self.params]
        self.handles = []

    def register(self):
        for p, o in zip(self.params, self.optimizers):
            def hook(param, o=o):
                o.step()
                o.zero_grad()

            self.handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


# -------------------------------------------------------------- tracking ----


class PhaseMemTracker(MemTracker):
    """MemTracker that also records, for the step, the maximum of every
    category on its own, the phase (set by the driver) in which the total
    peaked, and the peak total of every phase."""

    def __init__(self):
        super().__init__()
        self.phase = "setup"
        self.cat_max = {}
        self.peak_phase = None
        self.phase_peak = {}

    def _update_peak_stats(self, peak_state):
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        self._observe()
        if self._peak_mem != before:
            self.peak_phase = self.phase

    def _observe(self):
        for dev_snap in self._curr_mem_snap.values():
            for k, v in dev_snap.items():
                key = str(k.value) if hasattr(k, "value") else str(k)
                if self.cat_max.get(key, 0) < v:
                    self.cat_max[key] = v
            tot = dev_snap.get(TOTAL_KEY, 0)
            if self.phase_peak.get(self.phase, 0) < tot:
                self.phase_peak[self.phase] = tot

    def set_phase(self, phase):
        self.phase = phase
        self._observe()


def to_memfit(snap):
    """MemTracker per-category dict (keys _MemRefType or 'Total') -> memfit names."""
    out = {c: 0 for c in CATEGORIES}
    total = 0
    for k, v in snap.items():
        if k == TOTAL_KEY or str(k) == TOTAL_KEY:
            total = v
            continue
        ref = k if isinstance(k, _MemRefType) else _MemRefType(k)
        out[CATEGORY_MAP[ref]] += v
    return dict(total=total, **out)


def torchtitan_op_sac():
    """torchtitan's selective (per-op) activation checkpointing context, as
    its `_apply_ac_to_transformer_block` builds it (torchtitan @ 9dec370,
    torchtitan/parallelisms/parallelize_llama.py): save the outputs of the
    ops on its save list, except every second `aten.mm` of the block
    (counted separately in the forward and in the recomputation), and
    recompute everything else. Its list names the CUDA sdpa kernels; on
    this cpu reference sdpa runs `_scaled_dot_product_flash_attention_for_cpu`,
    the same saved set, so it is on the list too."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.abs.default,
        aten.max.default,
    }
    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        key = f"{mode}_mm_count"
        if func == aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def run_config(c, device="cpu"):
    torch.manual_seed(0)
    fake = FakeTensorMode()
    with fake, torch.device(device):
        # bf16-model: the module built in bf16, no autocast: the activations
        # of DeepSpeed's bf16 mode and FSDP's mixed precision (which keep
        # their fp32 master copy in the optimizer; plain AdamW here keeps
        # bf16 state, so only activations and temporaries compare). Built
        # under a bf16 default dtype: fake parameters cannot be swapped by
        # `model.to`.
        previous = torch.get_default_dtype()
        if c["precision"] == "bf16-model":
            torch.set_default_dtype(torch.bfloat16)
        try:
            model, hf_fields = build_model(c["model"], c["dropout"], c["attention"])
            if c["checkpointing"] == "selective":
                # torchtitan's per-op policy on transformers' layers: the
                # non-reentrant checkpoint with a selective context.
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={
                        "use_reentrant": False,
                        "context_fn": torchtitan_op_sac,
                    }
                )
            elif c["checkpointing"] != "none":
                # transformers' gradient checkpointing (every decoder layer
                # a GradientCheckpointingLayer), torch.utils.checkpoint with
                # use_reentrant as named.
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={
                        "use_reentrant": c["checkpointing"] == "reentrant"
                    }
                )
        finally:
            torch.set_default_dtype(previous)
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        n_params = sum(p.numel() for p in model.parameters())

        def adamw(params):
            return torch.optim.AdamW(
                params,
                lr=1e-4,
                weight_decay=0.01,
                foreach=(c["optimizer"] == "adamw-foreach"),
                fused=False,
            )

        in_bwd = InBackward(model, adamw) if c["optimizer_in_bwd"] else None
        opt = in_bwd if in_bwd is not None else adamw(param_groups(model, c["groups"]))
        vocab = hf_fields["vocab_size"]
        x = torch.randint(0, vocab, (c["batch"], c["seq_len"]), dtype=torch.long)

        def autocast():
            if c["precision"] == "bf16-autocast":
                return torch.autocast(device, dtype=torch.bfloat16)
            return contextlib.nullcontext()

        def step(mt=None):
            ph = mt.set_phase if mt is not None else (lambda p: None)
            ph("forward")
            with autocast():
                if c["loss"] == "full":
                    loss = model(input_ids=x, labels=x).loss
                else:
                    loss = chunked_loss(model, x, int(c["loss"].split("-")[1]))
            ph("backward")
            if in_bwd is not None:
                in_bwd.register()
            loss.backward()
            if in_bwd is not None:
                in_bwd.remove()
            del loss
            ph("optimizer")
            opt.step()
            ph("zero_grad")
            opt.zero_grad(set_to_none=c["set_to_none"])
            ph("end")

        step()  # step 1, untracked: creates AdamW's state
        mt = PhaseMemTracker()
        optimizers = in_bwd.optimizers if in_bwd is not None else [opt]
        mt.track_external(model, *optimizers, x)
        with mt:
            mt.set_phase("start")
            step(mt)
        peak = mt.get_tracker_snapshot("peak")
        if len(peak) != 1:
            raise RuntimeError(f"expected one device, got {list(peak)}")
        (dev,) = peak.keys()
        split = to_memfit(peak[dev])
        catmax = to_memfit(
            {
                (TOTAL_KEY if k == TOTAL_KEY else _MemRefType(k)): v
                for k, v in mt.cat_max.items()
            }
        )
        if catmax["total"] != split["total"]:
            raise RuntimeError(
                f"peak total mismatch {catmax['total']} != {split['total']}"
            )
        model_config = {
            k: v
            for k, v in hf_fields.items()
            if k not in ("use_cache",)
        }
        if c["family"] == "gpt2":
            model_config.update(
                resid_pdrop=c["dropout"], embd_pdrop=c["dropout"], attn_pdrop=c["dropout"]
            )
        else:
            model_config.update(attention_dropout=c["dropout"])
        model_config["n_params"] = n_params
        model_config["param_dtype"] = dtypes[0] if len(dtypes) == 1 else dtypes
        return dict(
            name=c["name"],
            family=c["family"],
            model=c["model"],
            hf_class=type(model).__name__,
            model_config=model_config,
            batch=c["batch"],
            seq_len=c["seq_len"],
            precision=c["precision"],
            dropout=c["dropout"],
            attention=c["attention"],
            optimizer=c["optimizer"],
            set_to_none=c["set_to_none"],
            loss=c["loss"],
            groups=c["groups"],
            checkpointing=c["checkpointing"],
            optimizer_in_bwd=c["optimizer_in_bwd"],
            device=f"fake-{dev}",
            # How transformers ran the experts (None without them).
            experts_implementation=getattr(model.config, "_experts_implementation", None)
            if hasattr(model.config, "num_experts_per_tok")
            else None,
            peak_bytes=catmax,
            split_at_peak=split,
            peak_phase=mt.peak_phase,
            phase_peak_total=dict(mt.phase_peak),
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "hf_memory.json"))
    ap.add_argument("--only", action="append", help="run configs whose name contains this (repeatable)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument(
        "--device",
        default="cpu",
        help="fake device (default cpu). 'cuda' needs a CUDA driver even for fake "
        "tensors: without one loss.backward() fails (hasPrimaryContext)",
    )
    args = ap.parse_args()

    configs = all_configs()
    if args.device != "cpu":
        for c in configs:
            c["name"] += "-" + args.device
    if args.only:
        configs = [c for c in configs if any(s in c["name"] for s in args.only)]
    if args.list:
        for c in configs:
            print(c["name"])
        return 0

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results, failures = [], []
    hdr = f"{'config':58s} {'total':>9s} {'param':>8s} {'grad':>8s} {'opt':>8s} {'act':>9s} {'temp':>9s} {'phase':>9s} {'secs':>5s}"
    print("MiB at the peak of step 2 (split_at_peak); total = peak total")
    print(hdr)
    for c in configs:
        t0 = time.time()
        try:
            r = run_config(c, args.device)
        except Exception as e:  # keep going; record what failed
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            failures.append(dict(name=c["name"], error=msg))
            print(f"{c['name']:58s} FAILED {msg}", flush=True)
            continue
        dt = time.time() - t0
        results.append(r)
        s = r["split_at_peak"]
        print(
            f"{c['name']:58s} {s['total']/MIB:9.1f} {s['parameters']/MIB:8.1f} {s['gradients']/MIB:8.1f} "
            f"{s['optimizer']/MIB:8.1f} {s['activations']/MIB:9.1f} {s['temporaries']/MIB:9.1f} "
            f"{str(r['peak_phase']):>9s} {dt:5.0f}",
            flush=True,
        )

    doc = dict(
        generated_by="tests/reference/hf_memory.py",
        date=datetime.date.today().isoformat(),
        versions=dict(
            python=platform.python_version(),
            torch=torch.__version__,
            transformers=transformers.__version__,
        ),
        method=(
            "FakeTensorMode (fake cpu tensors) + torch.distributed._tools.mem_tracker.MemTracker; "
            "step 2 of loss=model(input_ids=x,labels=x).loss; loss.backward(); opt.step(); "
            "opt.zero_grad(set_to_none); bytes are storage sizes, no allocator rounding"
        ),
        category_map={str(k.value): v for k, v in CATEGORY_MAP.items()},
        configs=results,
        failures=failures,
    )
    if args.only and os.path.exists(args.out):
        # Merge into an existing fixture: replace the configs that were rerun.
        with open(args.out) as f:
            old = json.load(f)
        names = {r["name"] for r in results} | {x["name"] for x in failures}
        keep = [r for r in old.get("configs", []) if r["name"] not in names]
        order = {c["name"]: i for i, c in enumerate(all_configs())}
        doc["configs"] = sorted(keep + results, key=lambda r: order.get(r["name"], 1 << 30))
        oldf = [x for x in old.get("failures", []) if x["name"] not in names]
        doc["failures"] = oldf + failures
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(doc['configs'])} configs, {len(doc['failures'])} failures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
