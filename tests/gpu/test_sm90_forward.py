"""The Hopper (Gluon) forward kernel against a float64 reference, flash-attn's error rule, and
the portable Triton kernel; skipped without an sm_90 GPU."""
import pytest
import torch

import flashtile
from flashtile.backends.triton import launch_sm90
from flashtile.backends.triton.fastlaunch import poison_outputs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")


def _reference(q, k, v, causal, dtype):
    """Attention of (B, S, H, D) inputs in ``dtype`` (bottom-right causal), with its lse."""
    qh, kh, vh = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, -1)
    return (torch.softmax(s, -1) @ vh).transpose(1, 2), lse


CASES = [  # (batch, sq, sk, heads, heads_k, d, causal)
    ("d128", 2, 256, 256, 4, 4, 128, False),
    ("d128-causal", 2, 384, 384, 4, 4, 128, True),
    ("d64-gqa", 1, 256, 512, 8, 2, 64, False),
    ("d64-causal-sk>sq", 2, 128, 512, 4, 4, 64, True),
    ("d128-long-causal", 1, 2048, 2048, 2, 1, 128, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_forward_matches_float64_reference(case, dtype, monkeypatch):
    _, batch, sq, sk, heads, heads_k, d, causal = case
    monkeypatch.setenv("FLASHTILE_SM90", "1")
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5, window_right=0 if causal else -1)
    assert launch_sm90.eligible(q, k, v, spec)
    with poison_outputs():
        out, lse = launch_sm90.forward(q, k, v, spec)
    ref, ref_lse = _reference(q, k, v, causal, torch.float64)
    low, _ = _reference(q, k, v, causal, dtype)
    err = (out.double() - ref).abs().max().item()
    base = (low.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= 2 * base + 1e-4, (err, base)
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3
    # the public function takes the same kernel and agrees with the portable one
    got = flashtile.flash_attn_func(q, k, v, causal=causal)
    monkeypatch.setenv("FLASHTILE_SM90", "0")
    portable = flashtile.flash_attn_func(q, k, v, causal=causal)
    assert torch.equal(got, out)
    assert (portable.double() - ref).abs().max().item() <= 2 * base + 1e-4
