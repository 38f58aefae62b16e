"""flash-attn 2.x API surface: the varlen packed functions, strided inputs, S_dmask without
dropout, and the names flash-attn exports.  Numerics are checked against a float64
reference (flash-attn's rule, tests/helpers.py) or bitwise against the unpacked call."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import flashtile
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


def test_conformance_alias_package_imports_and_rotary():
    """The ``flash_attn`` alias of tests/gpu/flash_attn_conformance exposes what flash-attn's
    test file imports, and its independent ``apply_rotary_emb`` agrees with flashtile's
    rotary code (run in a subprocess so the alias never enters this process's modules)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    alias = os.path.join(root, "tests", "gpu", "flash_attn_conformance", "alias")
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
