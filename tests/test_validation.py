"""Bad input raises a clear ValueError/TypeError naming the argument, before any kernel runs."""
from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import backends


@pytest.fixture(autouse=True)
def no_kernel(monkeypatch):
    """Any backend call during these tests is a failure: validation must come first."""
    def boom(name):
        raise AssertionError("a backend was reached before validation rejected the input")
    monkeypatch.setattr(backends, "get", boom)


def qkv(b=2, sq=8, sk=8, h=4, hk=4, d=16, dtype=torch.float16):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


def _replace(i, x):
    t = list(qkv())
    t[i] = x
    return t


BAD = [
    ("q-not-tensor", lambda: (_replace(0, [1.0]), {}), TypeError, "q"),
    ("q-rank3", lambda: (_replace(0, torch.randn(2, 8, 16, dtype=torch.float16)), {}), ValueError, "q"),
    ("k-rank5", lambda: (_replace(1, torch.randn(2, 8, 4, 16, 1, dtype=torch.float16)), {}), ValueError, "k"),
    ("int-dtype", lambda: (_replace(0, torch.ones(2, 8, 4, 16, dtype=torch.int32)), {}), TypeError, "q"),
    ("float64", lambda: ([x.double() for x in qkv()], {}), TypeError, "q"),
    ("mixed-dtype", lambda: (_replace(2, torch.randn(2, 8, 4, 16)), {}), TypeError, "v"),
    ("batch-mismatch", lambda: (list(qkv(b=2)[:1]) + list(qkv(b=3)[1:]), {}), ValueError, "batch"),
    ("kv-seqlen-mismatch", lambda: (_replace(2, torch.randn(2, 9, 4, 16, dtype=torch.float16)), {}), ValueError, "k and v"),
    ("headdim-mismatch", lambda: ((lambda q, k, v: [q, k[..., :8].contiguous(), v[..., :8].contiguous()])(*qkv()), {}), ValueError, "headdim"),
    ("heads-not-multiple", lambda: (qkv(h=4, hk=3), {}), ValueError, "nheads"),
    ("headdim-too-big", lambda: (qkv(d=264), {}), ValueError, "headdim"),
    ("window-type", lambda: (qkv(), {"window_size": 3}), TypeError, "window_size"),
    ("window-below-minus-one", lambda: (qkv(), {"window_size": (-2, 0)}), ValueError, "window_size"),
    ("softcap-negative", lambda: (qkv(), {"softcap": -1.0}), ValueError, "softcap"),
    ("dropout-out-of-range", lambda: (qkv(), {"dropout_p": 1.0}), ValueError, "dropout_p"),
    ("dropout-type", lambda: (qkv(), {"dropout_p": "0.1"}), TypeError, "dropout_p"),
    ("scale-type", lambda: (qkv(), {"softmax_scale": "x"}), TypeError, "softmax_scale"),
    ("scale-nan", lambda: (qkv(), {"softmax_scale": float("nan")}), ValueError, "softmax_scale"),
    ("alibi-shape", lambda: (qkv(), {"alibi_slopes": torch.rand(3)}), ValueError, "alibi_slopes"),
    ("alibi-dtype", lambda: (qkv(), {"alibi_slopes": torch.rand(4, dtype=torch.float16)}), TypeError, "alibi_slopes"),
]


@pytest.mark.parametrize("make,exc,needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_flash_attn_func_rejects(make, exc, needle):
    args, kwargs = make()
    with pytest.raises(exc, match=needle):
        flashtile.flash_attn_func(*args, **kwargs)


def test_different_devices_rejected():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="meta|device|cpu"):
        flashtile.flash_attn_func(q, k.to("meta"), v)


def _varlen(total_q=10, total_k=12):
    return (torch.randn(total_q, 4, 16, dtype=torch.float16), torch.randn(total_k, 2, 16, dtype=torch.float16),
            torch.randn(total_k, 2, 16, dtype=torch.float16))


VARLEN_BAD = [
    ("cu-int64", dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, "cu_seqlens_q"),
    ("cu-not-zero-start", dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32)), ValueError, "start at 0"),
    ("cu-decreasing", dict(cu_seqlens_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32),
                           cu_seqlens_k=torch.tensor([0, 4, 8, 12], dtype=torch.int32)), ValueError, "non-decreasing"),
    ("cu-total-mismatch", dict(cu_seqlens_k=torch.tensor([0, 5, 11], dtype=torch.int32)), ValueError, "cu_seqlens_k"),
    ("max-too-small", dict(max_seqlen_q=3), ValueError, "max_seqlen_q"),
    ("batch-mismatch", dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32), max_seqlen_k=12), ValueError, "sequences"),
    ("rank", dict(q=torch.randn(1, 10, 4, 16, dtype=torch.float16)), ValueError, "q"),
]


@pytest.mark.parametrize("override,exc,needle", [b[1:] for b in VARLEN_BAD], ids=[b[0] for b in VARLEN_BAD])
def test_varlen_rejects(override, exc, needle):
    q, k, v = _varlen()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=7)
    args.update(override)
    with pytest.raises(exc, match=needle):
        flashtile.flash_attn_varlen_func(**args)


SDPA_BAD = [
    ("gqa-without-flag", lambda: (torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)), {}, ValueError, "enable_gqa"),
    ("value-headdim", lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 8)), {}, ValueError, "head dim"),
    ("rank1", lambda: (torch.randn(16),) * 3, {}, ValueError, "query"),
    ("batch-dims", lambda: (torch.randn(2, 2, 8, 16), torch.randn(3, 2, 8, 16), torch.randn(3, 2, 8, 16)), {}, ValueError, "batch"),
    ("int-query", lambda: (torch.ones(1, 2, 8, 16, dtype=torch.int64), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)), {}, TypeError, "query"),
]


@pytest.mark.parametrize("make,kwargs,exc,needle", [b[1:] for b in SDPA_BAD], ids=[b[0] for b in SDPA_BAD])
def test_sdpa_rejects(make, kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        flashtile.scaled_dot_product_attention(*make(), **kwargs)
