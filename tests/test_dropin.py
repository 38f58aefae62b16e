"""The drop-in APIs: flash-attn 2.x's API surface (the varlen packed functions, strided inputs,
S_dmask without dropout, the names flash-attn exports, the alias package of the conformance run)
and scaled_dot_product_attention as a drop-in for PyTorch's (torch 2.13 semantics: broadcast
batch/head dims, 2-D inputs, zero sizes, argument checking with PyTorch's names, fully masked
rows, and torch.func transforms).

Numerics are checked against float64 references (flash-attn's rule, tests/helpers.py) after
poisoning the kernels' outputs, against PyTorch's SDPA in float64, or bitwise against the
unpacked call.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.autograd import functorch_active
from flashtile.backends.triton.fastlaunch import poison_outputs

from helpers import assert_close, check_flash_rule, randn


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _padded_reference(lens_q, lens_k, causal):
    """Reference on packed ``(total, H, D)`` tensors: one SDPA call per sequence with a
    bottom-right causal mask (flash-attn's convention)."""
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()

    def ref(q, k, v, dtype):
        outs = []
        for b in range(len(lens_q)):
            qb, kb, vb = (x.to(dtype).transpose(0, 1) for x in (q[cq[b]:cq[b + 1]],
                                                                 k[ck[b]:ck[b + 1]],
                                                                 v[ck[b]:ck[b + 1]]))
            mask = None
            if causal:
                sq, sk = qb.shape[1], kb.shape[1]
                mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
            kb = kb.repeat_interleave(qb.shape[0] // kb.shape[0], dim=0)
            vb = vb.repeat_interleave(qb.shape[0] // vb.shape[0], dim=0)
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
                        .nan_to_num(0.0).transpose(0, 1))
        return torch.cat(outs)
    return ref


# the packed functions only unbind and call flash_attn_varlen_func: one Triton case suffices
@pytest.mark.parametrize("causal,backend", [(False, "torch"), (True, "torch"), (True, "triton")],
                         ids=["full-torch", "causal-torch", "causal-triton"])
def test_varlen_qkvpacked_equals_unpacked_and_float64(causal, backend):
    lens, h, d = [7, 0, 12, 3], 2, 16
    gen = torch.Generator().manual_seed(21 + causal)
    qkv = randn(sum(lens), 3, h, d, gen=gen)
    do = randn(sum(lens), h, d, gen=gen)
    cu, max_len = _cu(lens), max(lens)
    packed = qkv.clone().requires_grad_()
    leaves = [x.clone().requires_grad_() for x in qkv.unbind(1)]
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.flash_attn_varlen_qkvpacked_func(packed, cu, max_len, causal=causal)
        (dqkv,) = torch.autograd.grad(out, packed, do)
        want = flashtile.flash_attn_varlen_func(*leaves, cu, cu, max_len, max_len, causal=causal)
        grads = torch.autograd.grad(want, leaves, do)
    assert torch.equal(out, want), "packed out differs from the unpacked call"
    assert torch.equal(dqkv, torch.stack(grads, dim=1)), "dqkv differs from the unpacked grads"
    check_flash_rule("varlen_qkvpacked", out, dqkv.unbind(1), list(qkv.unbind(1)), do,
                     _padded_reference(lens, lens, causal), torch.float32,
                     grad_names=("dq", "dk", "dv"))


@pytest.mark.parametrize("backend", ["torch"])
def test_varlen_kvpacked_gqa_equals_unpacked_and_float64(backend):
    lens_q, lens_k, h, hk, d = [5, 9, 1], [11, 9, 4], 4, 2, 16
    gen = torch.Generator().manual_seed(33)
    q = randn(sum(lens_q), h, d, gen=gen)
    kv = randn(sum(lens_k), 2, hk, d, gen=gen)
    do = randn(sum(lens_q), h, d, gen=gen)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    leaves = [x.clone().requires_grad_() for x in (q, *kv.unbind(1))]
    with flashtile.use_backend(backend), poison_outputs():
        out, lse, s_dmask = flashtile.flash_attn_varlen_kvpacked_func(
            q1, kv1, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_attn_probs=True)
        dq, dkv = torch.autograd.grad(out, (q1, kv1), do)
        want = flashtile.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k),
                                                causal=True)
        grads = torch.autograd.grad(want, leaves, do)
    assert lse.shape == (h, sum(lens_q)) and s_dmask.shape == (0,)
    assert torch.equal(out, want) and torch.equal(dq, grads[0])
    assert torch.equal(dkv, torch.stack(grads[1:], dim=1))
    check_flash_rule("varlen_kvpacked", out, (dq, *dkv.unbind(1)), [q, *kv.unbind(1)], do,
                     _padded_reference(lens_q, lens_k, True), torch.float32,
                     grad_names=("dq", "dk", "dv"))


# (id, function): every entry point takes q/k/v whose last dim has stride 2
STRIDED = ["flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention"]


@pytest.mark.parametrize("fn", STRIDED)
def test_strided_last_dim_is_copied_not_rejected(fn):
    gen = torch.Generator().manual_seed(4)
    wide = [randn(2, 9, 2, 32, gen=gen) for _ in range(3)]
    strided = [x[..., ::2] for x in wide]
    assert all(x.stride(-1) == 2 for x in strided)
    leaves = [x.clone().requires_grad_() for x in wide]
    dense = [x.detach()[..., ::2].contiguous().requires_grad_() for x in wide]

    def call(q, k, v):
        if fn == "flash_attn_func":
            return flashtile.flash_attn_func(q, k, v, causal=True)
        if fn == "flash_attn_varlen_func":
            cu = _cu([9, 9])
            return flashtile.flash_attn_varlen_func(*(x.reshape(18, 2, 16) for x in (q, k, v)),
                                                    cu, cu, 9, 9, causal=True)
        return flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)

    with flashtile.use_backend("torch"):
        out = call(*(x[..., ::2] for x in leaves))
        want = call(*dense)
        do = torch.randn_like(want)
        grads = torch.autograd.grad(out, leaves, do)
        want_grads = torch.autograd.grad(want, dense, do)
    assert_close("out", out, want, atol=0)
    for g, w in zip(grads, want_grads):
        assert_close("grad (odd channels untouched)", g[..., 1::2], torch.zeros_like(w), atol=0)
        assert_close("grad", g[..., ::2], w, atol=0)


@pytest.mark.parametrize("fn", ["flash_attn_func", "flash_attn_qkvpacked_func",
                                "flash_attn_kvpacked_func", "flash_attn_varlen_func",
                                "flash_attn_varlen_qkvpacked_func"])
def test_attn_probs_without_dropout_are_empty(fn):
    """flash-attn returns an empty S_dmask of q's dtype when dropout_p == 0: nothing N x N."""
    qkv = torch.randn(2, 6, 3, 2, 8, dtype=torch.float16)
    cu = _cu([6, 6])
    calls = {
        "flash_attn_func": lambda: flashtile.flash_attn_func(*qkv.unbind(2),
                                                             return_attn_probs=True),
        "flash_attn_qkvpacked_func": lambda: flashtile.flash_attn_qkvpacked_func(
            qkv, return_attn_probs=True),
        "flash_attn_kvpacked_func": lambda: flashtile.flash_attn_kvpacked_func(
            qkv[:, :, 0], qkv[:, :, 1:], return_attn_probs=True),
        "flash_attn_varlen_func": lambda: flashtile.flash_attn_varlen_func(
            *qkv.reshape(12, 3, 2, 8).unbind(1), cu, cu, 6, 6, return_attn_probs=True),
        "flash_attn_varlen_qkvpacked_func": lambda: flashtile.flash_attn_varlen_qkvpacked_func(
            qkv.reshape(12, 3, 2, 8), cu, 6, return_attn_probs=True),
    }
    with flashtile.use_backend("torch"):
        out, lse, s_dmask = calls[fn]()
    assert s_dmask.shape == (0,) and s_dmask.dtype == torch.float16
    assert lse.dtype == torch.float32 and torch.isfinite(lse).all()


# flash-attn 2.x's parameter names, in order (flash_attn/flash_attn_interface.py)
SIGNATURES = {
    "flash_attn_varlen_qkvpacked_func": [
        "qkv", "cu_seqlens", "max_seqlen", "dropout_p", "softmax_scale", "causal",
        "window_size", "softcap", "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_varlen_kvpacked_func": [
        "q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
        "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
        "return_attn_probs"],
    "unpad_input": ["hidden_states", "attention_mask", "unused_mask"],
    "pad_input": ["hidden_states", "indices", "batch", "seqlen"],
    "index_first_axis": ["input", "indices"],
    "index_put_first_axis": ["values", "indices", "first_axis_dim"],
    "unpad_input_for_concatenated_sequences": ["hidden_states", "attention_mask_in_length"],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_flash_attn_names_and_signatures(name):
    assert name in flashtile.__all__
    params = list(inspect.signature(getattr(flashtile, name)).parameters)
    assert params == SIGNATURES[name]


@pytest.mark.parametrize("bad", ["qkv-3d", "qkv-dim1", "kv-dim1"])
def test_varlen_packed_bad_shapes_name_the_argument(bad):
    cu = _cu([4])
    with pytest.raises(ValueError, match="qkv|kv"):
        if bad == "qkv-3d":
            flashtile.flash_attn_varlen_qkvpacked_func(torch.randn(4, 3, 8), cu, 4)
        elif bad == "qkv-dim1":
            flashtile.flash_attn_varlen_qkvpacked_func(torch.randn(4, 2, 2, 8), cu, 4)
        else:
            flashtile.flash_attn_varlen_kvpacked_func(torch.randn(4, 2, 8),
                                                      torch.randn(4, 3, 2, 8), cu, cu, 4, 4)


def _conformance_module():
    """tests/gpu/flash_attn_conformance.py, loaded from its path (it is a script, not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu",
                        "flash_attn_conformance.py")
    spec = importlib.util.spec_from_file_location("flash_attn_conformance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_conformance_alias_package_imports_and_rotary(tmp_path):
    """The ``flash_attn`` alias that tests/gpu/flash_attn_conformance.py writes exposes what
    flash-attn's test file imports, and its independent ``apply_rotary_emb`` agrees with
    flashtile's rotary code (run in a subprocess so the alias never enters this process's
    modules)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    alias = str(_conformance_module().write_alias(tmp_path))
    code = """
import torch, flashtile
from flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from flash_attn.bert_padding import pad_input, unpad_input, index_first_axis
from flash_attn.flash_attn_interface import _get_block_size_n, USE_TRITON_ROCM
from flash_attn.layers.rotary import apply_rotary_emb
from flashtile.rotary import apply_rotary
assert flash_attn_varlen_qkvpacked_func is flashtile.flash_attn_varlen_qkvpacked_func
x = torch.randn(2, 5, 3, 16)
cos, sin = torch.randn(12, 4), torch.randn(12, 4)
offsets = torch.tensor([2, 7])
pos = torch.arange(5)[None] + offsets[:, None]
for inter in (False, True):
    got = apply_rotary_emb(x, cos, sin, interleaved=inter, seqlen_offsets=offsets)
    assert torch.allclose(got, apply_rotary(x, cos, sin, pos, interleaved=inter), atol=1e-6)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    packed = apply_rotary_emb(x.reshape(10, 3, 16), cos, sin, interleaved=inter,
                              seqlen_offsets=offsets, cu_seqlens=cu)
    assert torch.allclose(packed.view(2, 5, 3, 16), got, atol=1e-6)
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([alias, root]))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_conformance_jobs_summaries_merge_per_function():
    """``--jobs``: the summaries of processes that ran disjoint test functions merge into one
    whose rows come from the process that selected each function (another process only saw it
    collected), with failures joined and the longest wall time."""
    conf = _conformance_module()

    def row(sampled=0, passed=0, failed=0, excluded=0):
        return {"collected": 10, "excluded": excluded, "excluded_reason": "", "sampled": sampled,
                "passed": passed, "failed": failed, "skipped": 0, "not_run": 0}

    base = {"test_file": "t.py", "test_file_sha256": "0" * 64, "flashtile_commit": "abc",
            "sample_per_function": 2, "seed": "1", "s_dmask_mode": "normalized",
            "environment": {}, "notes": ["same note"]}
    a = dict(base, wall_s=30.0, functions={"test_a": row(2, 2), "test_b": row(),
                                           "test_x": row()},
             failures=[])
    b = dict(base, wall_s=45.5, functions={"test_a": row(), "test_b": row(2, 1, 1),
                                           "test_x": row(excluded=2)},
             failures=[{"test": "test_b[1]", "error": "boom"}])
    merged = conf.merge_summaries([a, b])
    assert merged["functions"]["test_a"]["passed"] == 2
    assert (merged["functions"]["test_b"]["passed"], merged["functions"]["test_b"]["failed"]) == (1, 1)
    assert merged["functions"]["test_x"]["excluded"] == 2
    assert merged["failures"] == [{"test": "test_b[1]", "error": "boom"}]
    assert merged["wall_s"] == 45.5 and merged["jobs"] == 2 and merged["notes"] == ["same note"]
    text = conf._markdown(merged)
    assert "2 pytest processes at once" in text and "| **total** | 30 | 2 | 4 | 3 | 1 |" in text


# ----------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# ----------------------------------------------------------------------------------------------

BACKENDS = ["triton", "torch"]
ft_sdpa = flashtile.scaled_dot_product_attention

# (id, query shape, key shape, value shape, kwargs); E = 16 throughout, the value head dim
# too but where a case says otherwise (computed at the larger head dim, zeros padded in)
CASES = [
    ("2d", (9, 16), (13, 16), (13, 16), {}),
    ("2d-causal", (9, 16), (13, 16), (13, 16), {"is_causal": True}),
    ("3d-q-4d-kv", (2, 9, 16), (3, 2, 13, 16), (3, 2, 13, 16), {}),
    ("2d-q-4d-kv-causal", (9, 16), (2, 3, 13, 16), (2, 3, 13, 16), {"is_causal": True}),
    ("kv-batch-1", (3, 2, 9, 16), (1, 2, 13, 16), (1, 2, 13, 16), {}),
    ("q-batch-1", (1, 2, 9, 16), (3, 2, 13, 16), (3, 2, 13, 16), {"is_causal": True}),
    ("kv-heads-1-no-gqa", (2, 4, 9, 16), (2, 1, 13, 16), (2, 1, 13, 16), {}),
    ("q-heads-1", (2, 1, 9, 16), (2, 3, 13, 16), (2, 3, 13, 16), {}),
    ("k-heads-1-v-heads-2", (2, 2, 9, 16), (2, 1, 13, 16), (2, 2, 13, 16), {}),
    ("5d-kv-batch-broadcast", (2, 3, 2, 9, 16), (1, 3, 2, 13, 16), (2, 1, 2, 13, 16), {}),
    ("gqa-kv-batch-1", (2, 4, 9, 16), (1, 2, 13, 16), (1, 2, 13, 16),
     {"enable_gqa": True, "is_causal": True}),
    ("kv-batch-1-bias", (3, 2, 9, 16), (1, 2, 13, 16), (1, 2, 13, 16), {"mask": (9, 13)}),
    ("value-dim-8", (2, 2, 9, 16), (2, 2, 13, 16), (2, 2, 13, 8), {}),
    ("value-dim-24-gqa-causal", (2, 4, 9, 16), (2, 2, 13, 16), (2, 2, 13, 24),
     {"enable_gqa": True, "is_causal": True}),
    ("value-dim-8-kv-batch-1-bias", (3, 2, 9, 16), (1, 2, 13, 16), (1, 2, 13, 8),
     {"mask": (9, 13)}),
]


def _ref(kw):
    """The SDPA formula with PyTorch ops in ``dtype`` (matmul broadcasting does the batch
    broadcast): float64 is the reference, the input dtype the error baseline."""
    def ref(q, k, v, *mask, dtype):
        q, k, v = (x.to(dtype) for x in (q, k, v))
        if kw.get("enable_gqa") and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
            k, v = (x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3) for x in (k, v))
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        if kw.get("is_causal"):
            L, S = s.shape[-2:]
            s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
        if mask:
            s = s + mask[0].to(dtype)
        return torch.softmax(s, dim=-1) @ v
    return ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_broadcast_shapes_match_torch_float64(case, dtype, backend):
    name, qs, ks, vs, kw = case
    gen = torch.Generator().manual_seed(len(name) * 31 + len(qs))
    q, k, v = (randn(*s, dtype=dtype, gen=gen) for s in (qs, ks, vs))
    kw = dict(kw)
    inputs = [q, k, v]
    if "mask" in kw:  # a learnable additive bias, broadcast over batch and heads
        inputs.append(randn(*kw.pop("mask"), dtype=dtype, gen=gen))
    leaves = [x.clone().requires_grad_() for x in inputs]
    with flashtile.use_backend(backend), poison_outputs():
        out = ft_sdpa(*leaves[:3], attn_mask=leaves[3] if len(leaves) > 3 else None, **kw)
        want_shape = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                    enable_gqa=kw.get("enable_gqa", False)).shape
        assert out.shape == want_shape, f"{name}: shape {tuple(out.shape)} != {tuple(want_shape)}"
        do = randn(*out.shape, dtype=dtype, gen=gen)
        grads = torch.autograd.grad(out, leaves, do)
    for g, x in zip(grads, inputs):
        assert g.shape == x.shape
    check_flash_rule(name, out, grads, inputs, do, _ref(kw), dtype,
                     grad_names=("dq", "dk", "dv", "dmask"))


# (id, query lengths, key lengths, heads, key/value heads, E, value head dim, causal): nested
# tensors with the jagged layout, one sequence a batch entry; key lengths None: the keys share
# the query's ragged dimension (its offsets)
JAGGED = [
    ("self-causal-gqa", [3, 5, 2], [3, 5, 2], 4, 2, 16, 16, True),
    ("self-shared-ragged-causal", [4, 1, 6], None, 2, 2, 16, 16, True),
    # causal is top-left per sequence: the second has more queries than keys
    ("cross-causal-value-dim-8", [3, 5, 2], [6, 2, 4], 2, 2, 16, 8, True),
    ("cross", [7, 1, 4], [2, 9, 5], 2, 2, 16, 16, False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", JAGGED, ids=[c[0] for c in JAGGED])
def test_jagged_nested_tensors_match_float64_per_sequence(case, dtype, backend):
    """Nested (jagged) ``(B, H, j, E)`` inputs, as PyTorch's SDPA takes them: the output is a
    jagged tensor sharing the query's ragged dimension, and its values and the gradients of
    the packed inputs are each sequence's attention within flash-attn's rule of float64."""
    name, lq, lk, heads, heads_kv, e, ev, causal = case
    gen = torch.Generator().manual_seed(len(name))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()]) for n in (lq, lk or lq))
    if lk is None:
        lk, cu_k = lq, cu_q
    inputs = [randn(sum(lq), heads, e, dtype=dtype, gen=gen),
              randn(sum(lk), heads_kv, e, dtype=dtype, gen=gen),
              randn(sum(lk), heads_kv, ev, dtype=dtype, gen=gen)]
    leaves = [x.clone().requires_grad_() for x in inputs]

    def jagged(x, cu):  # (total, H, D) values -> (B, H, j, D)
        return torch.nested.nested_tensor_from_jagged(x, offsets=cu).transpose(1, 2)
    q, k, v = jagged(leaves[0], cu_q), jagged(leaves[1], cu_k), jagged(leaves[2], cu_k)
    assert (k.shape[2] is q.shape[2]) == (cu_k is cu_q)
    with flashtile.use_backend(backend), poison_outputs():
        out = ft_sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        assert out.is_nested and out.shape[2] is q.shape[2] and out.shape[:2] == q.shape[:2]
        values = out.transpose(1, 2).values()
        assert values.shape == (sum(lq), heads, ev)
        do = randn(*values.shape, dtype=dtype, gen=gen)
        grads = torch.autograd.grad(values, leaves, do)
    ref_one = _ref({"is_causal": causal, "enable_gqa": True})

    def ref(q_, k_, v_, dtype):  # each sequence's (H, L, E) attention, packed again
        return torch.cat([ref_one(q_[a:b].transpose(0, 1), k_[c:d].transpose(0, 1),
                                  v_[c:d].transpose(0, 1), dtype=dtype).transpose(0, 1)
                          for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])])
    check_flash_rule(name, values, grads, inputs, do, ref, dtype, grad_names=("dq", "dk", "dv"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_jagged_compiled_fullgraph_dynamic_equals_eager(backend, monkeypatch):
    """A jagged self-attention call (GQA, causal) under ``torch.compile(fullgraph=True,
    dynamic=True)``, on nested tensors that carry no longest length (the packed total bounds
    it while tracing): the output and the packed inputs' gradients equal the eager call's,
    for two batches of different lengths and counts; both hand the backend the bottom-right
    causal spec of a self-attention call (the Hopper kernels' case), not the top-left one."""
    impl = flashtile.backends.get(backend)
    specs = []
    real = impl.forward
    monkeypatch.setattr(impl, "forward", lambda *a, **kw: specs.append(a[3]) or real(*a, **kw))
    def f(x, kv):
        q, k = x.transpose(1, 2), kv.transpose(1, 2)
        return ft_sdpa(q, k, k, is_causal=True, enable_gqa=True).transpose(1, 2)
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(5)
    for lens in ([3, 5, 2], [7, 1, 4, 6]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        # (6 heads: PyTorch 2.13's dynamo fails to build its guards when a dimension of a
        # nested tensor without a cached longest length equals its batch + 1, as 4 would here)
        leaves = [randn(sum(lens), h, 16, gen=gen).requires_grad_() for h in (6, 2)]
        outs = []
        with flashtile.use_backend(backend):
            for fn in (compiled, f):
                x, kv = (torch.nested.nested_tensor_from_jagged(t, offsets=cu) for t in leaves)
                values = fn(x, kv).values()
                outs.append((values, *torch.autograd.grad(values, leaves,
                                                          torch.ones_like(values))))
        for name, got, want in zip(("out", "dq", "dkv"), *outs):
            assert_close(name, got, want, atol=1e-6, rtol=1e-5)
    assert len(specs) == 4 and all(s.bottom_right and s.window_right == 0 for s in specs)


def test_jagged_calls_hand_the_varlen_path_one_int32_offsets_tensor(monkeypatch):
    """Two calls on the same nested tensors give the varlen path the same int32 offsets object
    (its per-offsets tables are cached by identity); other nested tensors get their own."""
    from flashtile import interface
    seen = []
    real = interface.attention
    monkeypatch.setattr(interface, "attention", lambda *a, **kw: seen.append(
        kw["cu_seqlens_q"]) or real(*a, **kw))
    x = torch.nested.nested_tensor([torch.randn(n, 2, 16) for n in (3, 5)],
                                   layout=torch.jagged).transpose(1, 2)
    y = torch.nested.nested_tensor([torch.randn(n, 2, 16) for n in (3, 5)],
                                   layout=torch.jagged).transpose(1, 2)
    with flashtile.use_backend("torch"):
        for q in (x, x, y):
            ft_sdpa(q, q, q, is_causal=True)
    assert seen[0] is seen[1] and seen[2] is not seen[0]
    assert seen[0].dtype == torch.int32 and seen[0].tolist() == [0, 3, 8]


def test_jagged_nested_tensors_bad_input_names_the_argument():
    """Nested inputs: every one jagged ``(B, H, j, E)``; no attn_mask."""
    def jagged(*lens, h=2, e=16):
        return torch.nested.nested_tensor([torch.randn(n, h, e) for n in lens],
                                          layout=torch.jagged).transpose(1, 2)
    q = jagged(3, 4)
    with pytest.raises(ValueError, match="value: nested tensors must all have the jagged"):
        ft_sdpa(q, q, torch.randn(2, 2, 4, 16))
    with pytest.raises(ValueError, match="attn_mask is not supported with nested"):
        ft_sdpa(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="heads"):
        ft_sdpa(jagged(3, 4, h=3), q, q, enable_gqa=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float64_calls_are_pytorchs_own_and_pass_gradcheck(causal, backend):
    """float64 (which the kernels do not compute) runs PyTorch's own SDPA: the output and
    gradients equal ``F.scaled_dot_product_attention``'s bitwise on the same inputs (GQA, a
    broadcast bool mask or causal), are within 1e-12 of the formula in float64, and
    ``torch.autograd.gradcheck`` passes through the drop-in."""
    gen = torch.Generator().manual_seed(11 + causal)
    q, k, v = (randn(2, h, n, 8, dtype=torch.float64, gen=gen).requires_grad_()
               for h, n in ((4, 5), (2, 7), (2, 7)))
    mask = None if causal else torch.rand(1, 1, 5, 7, generator=gen) > 0.3
    kw = dict(attn_mask=mask, is_causal=causal, enable_gqa=True)
    with flashtile.use_backend(backend):
        out = ft_sdpa(q, k, v, **kw)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert torch.autograd.gradcheck(lambda *x: ft_sdpa(*x, **kw), (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    assert out.dtype == torch.float64 and torch.equal(out, want)
    for g, w in zip(grads, torch.autograd.grad(want, (q, k, v), torch.ones_like(want))):
        assert torch.equal(g, w)
    ref = _ref(dict(is_causal=causal, enable_gqa=True))(
        q, k, v, *(() if mask is None else (torch.zeros(mask.shape, dtype=torch.float64)
                                          .masked_fill(~mask, float("-inf")),)),
        dtype=torch.float64)
    torch.testing.assert_close(out, torch.nan_to_num(ref), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_one_gives_zeros_as_pytorch(backend):
    """``dropout_p = 1`` drops every probability: zeros and zero gradients, as PyTorch's SDPA
    (whose function runs the call)."""
    q = torch.randn(2, 3, 6, 16, requires_grad=True)
    with flashtile.use_backend(backend):
        out = ft_sdpa(q, q, q, dropout_p=1.0, is_causal=True)
        (grad,) = torch.autograd.grad(out.sum(), q)
    assert out.shape == q.shape and not out.any() and not grad.any()


@pytest.mark.parametrize("value_dim", [32, 128], ids=["value-smaller", "value-larger"])
def test_pad_head_dims_gives_key_and_value_one_layout(value_dim):
    """Multi-head latent attention's padding (``pad_head_dims``): the padded key or value takes
    the other's memory layout (here keys in ``(B, H, S, D)`` order, values in ``(B, S, H, D)``
    order, as transformers' DeepSeek-V3 makes them), so the Hopper kernels can walk both with
    the same coordinates; the padding is zeros and the original values are kept."""
    from flashtile.interface import pad_head_dims
    q = torch.randn(2, 3, 5, 64).transpose(1, 2)                       # (B, S, H, D) views
    k = torch.randn(2, 3, 5, 64).transpose(1, 2)
    v = torch.randn(2, 5, 3, value_dim)
    qp, kp, vp = pad_head_dims(q, k, v)
    width = max(64, value_dim)
    assert qp.shape == kp.shape[:-1] + (width,) and vp.shape == v.shape[:-1] + (width,)
    assert kp.stride() == vp.stride()
    for x, xp in ((q, qp), (k, kp), (v, vp)):
        assert torch.equal(xp[..., :x.shape[-1]], x)
        assert not xp[..., x.shape[-1]:].any()


# (id, query, key, value): every zero-size dimension PyTorch accepts
ZERO = [
    ("L0", (2, 3, 0, 16), (2, 3, 7, 16), (2, 3, 7, 16)),
    ("S0", (2, 3, 5, 16), (2, 3, 0, 16), (2, 3, 0, 16)),
    ("L0-S0", (2, 3, 0, 16), (2, 3, 0, 16), (2, 3, 0, 16)),
    ("H0", (2, 0, 5, 16), (2, 0, 7, 16), (2, 0, 7, 16)),
    ("E0", (2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, 0)),
    ("B0", (0, 3, 5, 16), (0, 3, 7, 16), (0, 3, 7, 16)),
    ("3d-L0", (3, 0, 16), (3, 7, 16), (3, 7, 16)),
    ("Ev0", (2, 3, 5, 16), (2, 3, 7, 16), (2, 3, 7, 0)),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ZERO, ids=[c[0] for c in ZERO])
def test_zero_sizes_match_torch(case, causal):
    name, qs, ks, vs = case
    inputs = [torch.randn(*s) for s in (qs, ks, vs)]
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = ft_sdpa(*leaves, is_causal=causal)
    t_leaves = [x.clone().requires_grad_() for x in inputs]
    want = F.scaled_dot_product_attention(*t_leaves, is_causal=causal)
    assert_close(f"{name}: out", out, want, atol=0)
    do = torch.randn_like(want)
    grads = torch.autograd.grad(out, leaves, do, allow_unused=True)
    t_grads = torch.autograd.grad(want, t_leaves, do, allow_unused=True)
    for g_name, g, t in zip(("dq", "dk", "dv"), grads, t_grads):
        g = torch.zeros_like(leaves[0 if g_name == "dq" else 1]) if g is None else g
        t = torch.zeros_like(g) if t is None else t
        assert_close(f"{name}: {g_name}", g, t, atol=0)


def test_fully_masked_rows_are_zero_like_torch_math():
    """PyTorch 2.13's MATH backend (the documented formula) also returns 0 for a row whose
    mask hides every key, with zero gradients: flashtile agrees with it."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (randn(1, 2, n, 8, gen=gen) for n in (4, 5, 5))
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ft_sdpa(*leaves, attn_mask=mask)
    t_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(*t_leaves, attn_mask=mask)
    assert_close("masked row (torch MATH)", want[:, :, 1], torch.zeros_like(want[:, :, 1]), atol=0)
    assert_close("out", out, want, atol=2e-6)
    do = torch.randn_like(out)
    for g_name, g, t in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, do),
                            torch.autograd.grad(want, t_leaves, do)):
        assert_close(g_name, g, t, atol=2e-6)


def test_signature_and_argument_errors_use_pytorch_names():
    q = torch.randn(2, 3, 5, 8)
    with pytest.raises(TypeError, match="positional"):
        ft_sdpa(q, q, q, None, 0.0, False, 0.5)  # scale is keyword-only, as in PyTorch
    with pytest.raises(TypeError, match="positional"):
        ft_sdpa(q, q, q, None, 0.0, False, None, True)  # enable_gqa too
    with pytest.raises(TypeError, match="is_causal must be bool, not int"):
        ft_sdpa(q, q, q, is_causal=1)
    with pytest.raises(TypeError, match="is_causal must be bool, not Tensor"):
        ft_sdpa(q, q, q, is_causal=torch.tensor(True))
    with pytest.raises(ValueError, match="^scale must be finite"):
        ft_sdpa(q, q, q, scale=float("inf"))
    with pytest.raises(TypeError, match="^scale must be a float"):
        ft_sdpa(q, q, q, scale="0.5")
    with pytest.raises(ValueError, match="^query must have shape"):
        ft_sdpa(q[0, 0, 0], q, q)
    with pytest.raises(ValueError, match="query has 3 heads but key/value have 2"):
        ft_sdpa(q, q[:, :2], q[:, :2])
    with pytest.raises(ValueError, match="not broadcastable"):
        ft_sdpa(q, torch.randn(3, 3, 5, 8), torch.randn(3, 3, 5, 8))
    with pytest.raises(ValueError, match="headdim of query"):
        ft_sdpa(*(torch.randn(1, 1, 2, 300) for _ in range(3)))
    with pytest.raises(TypeError, match="^key has dtype float16"):
        ft_sdpa(q, q.half(), q.half())


def test_scale_as_a_one_element_tensor():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(1, 2, 6, 8, gen=gen) for _ in range(3))
    assert_close("tensor scale", ft_sdpa(q, k, v, scale=torch.tensor(0.3)),
                 ft_sdpa(q, k, v, scale=0.3), atol=0)


def _graph_nodes(fn, depth=4) -> set[str]:
    """Names of the autograd nodes within ``depth`` steps of ``fn``."""
    if fn is None or depth == 0:
        return set()
    names = {type(fn).__name__}
    for nxt, _ in fn.next_functions:
        names |= _graph_nodes(nxt, depth - 1)
    return names


def _per_sample_loss(fn):
    return lambda q, k, v: (fn(q, k, v, is_causal=True) ** 2).sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_func_transforms_match_torch(backend):
    """grad, vmap and vmap(grad) (per-sample gradients) equal PyTorch SDPA's; eager calls
    outside a transform keep the fast autograd function."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (randn(2, 2, n, 8, gen=gen) for n in (5, 7, 7))
    with flashtile.use_backend(backend), poison_outputs():
        assert not functorch_active()
        eager = ft_sdpa(q.clone().requires_grad_(), k, v)
        assert "FlashAttnFunctionBackward" in _graph_nodes(eager.grad_fn)
        g = torch.func.grad(_per_sample_loss(ft_sdpa), argnums=(0, 1, 2))(q, k, v)
        o = torch.vmap(ft_sdpa, in_dims=(0, None, None))(q, k[0], v[0])
        ps = torch.vmap(torch.func.grad(_per_sample_loss(ft_sdpa)),
                        in_dims=(0, 0, None))(q, k, v[0])
    g_t = torch.func.grad(_per_sample_loss(F.scaled_dot_product_attention),
                          argnums=(0, 1, 2))(q, k, v)
    o_t = torch.vmap(F.scaled_dot_product_attention, in_dims=(0, None, None))(q, k[0], v[0])
    ps_t = torch.vmap(torch.func.grad(_per_sample_loss(F.scaled_dot_product_attention)),
                      in_dims=(0, 0, None))(q, k, v[0])
    for name, a, b in (("grad dq", g[0], g_t[0]), ("grad dk", g[1], g_t[1]),
                       ("grad dv", g[2], g_t[2]), ("vmap out", o, o_t),
                       ("vmap(grad) dq", ps, ps_t)):
        assert_close(name, a, b, atol=2e-5, rtol=1e-5)


def test_vmap_dropout_follows_randomness_mode():
    q = torch.randn(3, 2, 5, 8)
    f = lambda x: ft_sdpa(x, x, x, dropout_p=0.5)  # noqa: E731
    with pytest.raises(RuntimeError, match="randomness"):
        torch.vmap(f)(q)
    same = torch.vmap(f, randomness="same")(q[:1].expand(3, -1, -1, -1))
    assert_close("randomness='same': one mask", same[1:], same[:1].expand(2, -1, -1, -1), atol=0)
    diff = torch.vmap(f, randomness="different")(q[:1].expand(3, -1, -1, -1))
    assert not torch.equal(diff[0], diff[1]), "randomness='different' drew one mask"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("packed", [False, True], ids=["func", "qkvpacked"])
def test_deterministic_reaches_the_backward(compiled, packed, monkeypatch):
    """flash-attn's ``deterministic`` reaches the backend's backward as ``spec.deterministic``
    (on Hopper it selects the backward without atomics), through autograd and through the
    compiled op alike; the gradients do not depend on it here."""
    from flashtile import backends

    impl = backends.get("torch")
    seen = []
    real = impl.backward
    monkeypatch.setattr(impl, "backward",
                        lambda *a, **kw: seen.append(a[6].deterministic) or real(*a, **kw))
    qkv = torch.randn(1, 32, 3, 2, 16)

    def run(qkv, deterministic):
        if packed:
            return flashtile.flash_attn_qkvpacked_func(qkv, causal=True,
                                                       deterministic=deterministic)
        q, k, v = qkv.unbind(2)
        return flashtile.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)

    fn = torch.compile(run, fullgraph=True, dynamic=True) if compiled else run
    grads = []
    with flashtile.use_backend("torch"):
        for deterministic in (False, True):
            x = qkv.clone().requires_grad_()
            fn(x, deterministic).sum().backward()
            grads.append(x.grad)
    assert seen == [False, True]
    assert torch.equal(grads[0], grads[1])
