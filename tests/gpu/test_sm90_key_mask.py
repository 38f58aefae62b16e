"""Key masks (a padded batch's ``(B, 1, 1, Sk)`` bool mask) on the Hopper (Gluon) kernels:
forward and fused backward against a float64 reference under flash-attn's error rule, the
rows that see no key, and the launches they take; skipped without an sm_90 GPU."""
import pytest
import torch
from helpers import spy_keyword

import flashtile
from flashtile.autograd import attention
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton import launch_sm90
from flashtile.backends.triton.fastlaunch import poison_outputs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")


def _mask(kind: str, batch: int, sk: int, gen: torch.Generator) -> torch.Tensor:
    """A ``(B|1, 1, 1, sk)`` bool key mask of ``kind``."""
    mask = torch.ones(batch, 1, 1, sk, dtype=torch.bool)
    pads = (torch.arange(batch) * sk // (2 * max(batch - 1, 1))).tolist()
    if kind == "left":  # generation-style: row b padded by up to half the keys on the left
        for b, p in enumerate(pads):
            mask[b, ..., :p] = False
    elif kind == "right":
        for b, p in enumerate(pads):
            mask[b, ..., sk - p:] = False
    elif kind == "holes":  # not a range: every key read from the mask
        mask = torch.rand(batch, 1, 1, sk, generator=gen) < 0.7
    elif kind == "empty-row":  # batch entry 0 sees no key at all, entry 1 only key 0
        mask[0] = False
        mask[1, ..., 1:] = False
    elif kind == "broadcast":  # one row for the whole batch
        mask = torch.rand(1, 1, 1, sk, generator=gen) < 0.9
    return mask.cuda()


def _reference(q, k, v, mask, causal, dtype):
    """(out, lse) of masked attention of ``(B, S, H, D)`` inputs in ``dtype`` (bottom-right
    causal); a row that sees no key outputs 0, lse -inf."""
    qh, kh, vh = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    vis = mask.expand(q.shape[0], 1, q.shape[1], k.shape[1])
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        vis = vis & (j <= i + sk - sq)
    s = s.masked_fill(~vis, float("-inf"))
    seen = vis.any(-1, keepdim=True)
    # a row with no key: softmax of zeros, then multiplied by 0 (finite gradients)
    p = torch.softmax(torch.where(seen, s, 0.0), -1) * seen
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, -1)
    return (p @ vh).transpose(1, 2), lse


def _reference_grads(q, k, v, do, mask, causal, dtype):
    """``(dq, dk, dv)`` of the reference in float64 and in ``dtype``."""
    grads = []
    for dt in (torch.float64, dtype):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        _reference(*leaves, mask, causal, dt)[0].backward(do.to(dt))
        grads.append([x.grad for x in leaves])
    return grads


def _dq_within_rule(dq, q, k, v, do, mask, causal):
    """dq (bf16 inputs) within 3x PyTorch's bf16 error against float64."""
    ref, low = _reference_grads(q, k, v, do, mask, causal, torch.bfloat16)
    base = (low[0].double() - ref[0]).abs().max().item()
    return (dq.double() - ref[0]).abs().max().item() <= 3 * base + 1e-4


CASES = [  # (batch, sq, sk, heads, heads_k, d, causal, mask)
    ("d64-causal-left", 4, 1024, 1024, 4, 4, 64, True, "left"),
    ("d64-causal-right-gqa", 3, 512, 512, 4, 2, 64, True, "right"),
    ("d64-holes", 2, 640, 640, 3, 3, 64, False, "holes"),
    ("d64-long-causal-left", 2, 2048, 2048, 4, 2, 64, True, "left"),
    ("d128-left", 3, 384, 384, 4, 4, 128, False, "left"),
    ("d128-causal-right", 2, 1280, 1280, 4, 4, 128, True, "right"),
    ("d128-causal-holes-gqa", 2, 1152, 1152, 4, 2, 128, True, "holes"),
    ("d128-empty-row", 2, 256, 256, 2, 2, 128, False, "empty-row"),
    ("d64-causal-empty-row", 2, 384, 384, 2, 2, 64, True, "empty-row"),
    ("d128-broadcast-sk>sq", 2, 128, 512, 4, 4, 128, True, "broadcast"),
    # lengths that are not multiples of the tiles
    ("d128-causal-left-ragged", 3, 1000, 1000, 4, 4, 128, True, "left"),
    ("d64-right-ragged", 2, 333, 777, 4, 2, 64, False, "right"),
    ("d256-causal-left", 2, 512, 512, 4, 4, 256, True, "left"),
    ("d256-holes-ragged-gqa", 2, 300, 300, 4, 2, 256, False, "holes"),
    # a decoding step and a few new tokens against a left-padded cache (transformers' generate)
    ("d64-decode-left-gqa", 3, 1, 333, 4, 2, 64, True, "left"),
    ("d128-chunk-left", 3, 5, 700, 4, 4, 128, True, "left"),
]


def _inputs(case, dtype):
    _, batch, sq, sk, heads, heads_k, d, causal, kind = case
    gen = torch.Generator().manual_seed(sum(map(ord, case[0])))
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    do = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    return q, k, v, do, _mask(kind, batch, sk, gen), causal


def _spy(monkeypatch, name):
    """The ``key_mask`` argument of each call of ``launch_sm90.<name>``."""
    return spy_keyword(monkeypatch, launch_sm90, name, "key_mask")


# head dims the forward runs at the next width (launch_sm90.padded_width; the backward of
# these runs the portable kernels, or with PAD_BWD_VIEWS the Hopper kernels of that width)
PADDED_CASES = [
    ("d96-causal-left-gqa", 3, 512, 512, 4, 2, 96, True, "left"),
    ("d96-holes-ragged", 2, 300, 333, 4, 4, 96, False, "holes"),
    ("d192-causal-right-ragged", 2, 500, 500, 4, 4, 192, True, "right"),
]


# (case, FWD_SPLIT): the padded head dims through the split kernel as well
FWD_CASES = [(c, False) for c in CASES + PADDED_CASES] + [(c, True) for c in PADDED_CASES]


@pytest.mark.parametrize("case,split", FWD_CASES,
                         ids=[c[0] + ("-split" if split else "") for c, split in FWD_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_key_mask_forward_matches_float64_reference(case, split, dtype, monkeypatch):
    """The Hopper forward with a key mask: output within 2x PyTorch's same-dtype error of
    float64, lse within 1e-3, a row that sees no key 0 with lse -inf; the same as the
    portable Triton kernel's within that error (at head dims 96 and 192 too, run at the next
    width, or with ``FWD_SPLIT`` by the split kernel)."""
    monkeypatch.setattr(launch_sm90, "FWD_SPLIT", split)
    q, k, v, do, mask, causal = _inputs(case, dtype)
    d = q.shape[-1]
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0 if causal else -1)
    calls = _spy(monkeypatch, "forward")
    with poison_outputs():
        out, lse = attention(q, k, v, spec, attn_bias=mask)
    assert len(calls) == 1 and calls[0] is not None  # the Hopper kernel, with the key mask
    ref, ref_lse = _reference(q, k, v, mask, causal, torch.float64)
    low, _ = _reference(q, k, v, mask, causal, dtype)
    err = (out.double() - ref).abs().max().item()
    base = (low.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= 2 * base + 1e-4, (err, base)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= 1e-3
    monkeypatch.setenv("FLASHTILE_SM90", "0")
    portable, _ = attention(q, k, v, spec, attn_bias=mask)
    assert (portable.double() - ref).abs().max().item() <= 2 * base + 1e-4


# (case, BWD128_SPLIT): head dims of 64 and a smaller tile through the split kernel as well
BWD_CASES = [(c, False) for c in CASES + PADDED_CASES] + [
    (c, True) for c in PADDED_CASES if launch_sm90.split_width(c[6]) == 64]


@pytest.mark.parametrize("case,split", BWD_CASES,
                         ids=[c[0] + ("-split" if split else "") for c, split in BWD_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_key_mask_backward_matches_float64_reference(case, split, dtype, monkeypatch):
    """dQ, dK and dV with a key mask within 3x PyTorch's same-dtype error of float64: the
    fused Hopper backward at every length and head dim (at 96 and 192 the kernel of the next
    width through views of the head's columns: ``launch_sm90.PAD_BWD_VIEWS``, at any number
    of keys; at 96 with ``BWD128_SPLIT`` the split kernel), hidden keys and rows that see no
    key with zero gradients."""
    monkeypatch.setattr(launch_sm90, "BWD128_SPLIT", split)
    q, k, v, do, mask, causal = _inputs(case, dtype)
    sk, d = case[3], case[6]
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    if d not in (64, 128, 256):
        monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", True)
        monkeypatch.setattr(launch_sm90, "PAD_VIEW_KEYS", 1)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0 if causal else -1)
    calls = _spy(monkeypatch, "fused_backward")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        out, _ = attention(*leaves, spec, attn_bias=mask)
        out.backward(do)
    got = [x.grad for x in leaves]
    assert len(calls) == 1 and calls[0] is not None
    ref, low = _reference_grads(q, k, v, do, mask, causal, dtype)
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        err = (g.double() - r).abs().max().item()
        base = (lo.double() - r).abs().max().item()
        assert torch.isfinite(g).all() and err <= 3 * base + 1e-4, (name, err, base)
    # hidden keys get no gradient
    hidden = ~mask.expand(q.shape[0], 1, 1, sk)[:, 0, 0]               # [B, Sk]
    assert (got[1][hidden] == 0).all() and (got[2][hidden] == 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_key_mask_under_cuda_graphs_and_compile(causal):
    """A CUDA-graph replay of the forward and backward with a key mask (its range summary
    inside the capture) on new inputs and a new mask: output, dK and dV bitwise those of eager
    calls, dQ within the accumulator's order; ``torch.compile(fullgraph=True, dynamic=True)``
    gives the eager output."""
    from flashtile.backends import triton as backend

    gen = torch.Generator().manual_seed(5)
    spec = AttnSpec(softmax_scale=0.125, window_right=0 if causal else -1)
    q, k, v, do = (torch.randn(2, 1000, 4, 64, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    mask = _mask("left", 2, 1000, gen)
    out, lse = backend.forward(q, k, v, spec, attn_bias=mask)
    lse = lse.contiguous()
    backend.backward(do, q, k, v, out, lse, spec, attn_bias=mask)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out2, _ = backend.forward(q, k, v, spec, attn_bias=mask)
        grads = backend.backward(do, q, k, v, out, lse, spec, attn_bias=mask)
    new = [torch.randn_like(x) for x in (q, k, v, do)] + [_mask("right", 2, 1000, gen)]
    new_out, new_lse = backend.forward(*new[:3], spec, attn_bias=new[4])
    for x, y in zip((q, k, v, do, mask, out, lse), (*new, new_out, new_lse)):
        x.copy_(y)
    for g in (out2, *grads):
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out2, new_out)
    eager = backend.backward(new[3], *new[:3], new_out, new_lse.contiguous(), spec,
                             attn_bias=new[4])
    assert torch.equal(grads[1], eager[1]) and torch.equal(grads[2], eager[2])
    assert _dq_within_rule(grads[0], *new, causal)
    compiled = torch.compile(lambda q, k, v, m: attention(q, k, v, spec, attn_bias=m)[0],
                             fullgraph=True, dynamic=True)
    assert torch.equal(compiled(*new[:3], new[4]), new_out)


def test_sm90_sdpa_drop_in_takes_the_hopper_forward(monkeypatch):
    """The SDPA drop-in (``(B, H, S, D)``, top-left ``is_causal``) reaches the Hopper forward:
    with a ``(B, 1, 1, S)`` bool mask (as the key mask), and with ``is_causal`` at ``L == S``
    (where top-left is bottom-right); within 2x PyTorch's same-dtype error of float64."""
    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    mask = _mask("left", 2, 512, torch.Generator().manual_seed(1))
    calls = _spy(monkeypatch, "forward")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for kw in (dict(attn_mask=mask), dict(is_causal=True)):
        got = flashtile.scaled_dot_product_attention(q, k, v, **kw)
        ref = sdpa(q.double(), k.double(), v.double(), **kw)
        base = (sdpa(q, k, v, **kw).double() - ref).abs().max().item()
        assert (got.double() - ref).abs().max().item() <= 2 * base + 1e-4, kw
    assert len(calls) == 2 and calls[0] is not None and calls[1] is None


def test_sm90_key_mask_and_packed_calls_under_inference_mode_equal_no_grad():
    """Under ``torch.inference_mode`` (inference tensors have no version counter: the key-mask
    summary and the packed order tables are not cached) a padded SDPA call and a packed call
    give their ``torch.no_grad`` outputs bitwise, call after call."""
    from flashtile import flash_attn_varlen_func

    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    mask = _mask("left", 2, 512, torch.Generator().manual_seed(2)).cuda()
    cu = torch.tensor([0, 300, 429, 1024], dtype=torch.int32, device="cuda")
    flat = [x.transpose(1, 2).reshape(1024, 4, 64) for x in (q, k, v)]

    def calls(q, k, v, mask, flat, cu):
        return (flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                flash_attn_varlen_func(*flat, cu, cu, 595, 595, causal=True))

    with torch.no_grad():
        want = calls(q, k, v, mask, flat, cu)
    with torch.inference_mode():
        frozen = [x.clone() for x in (q, k, v, mask)], [x.clone() for x in flat], cu.clone()
        for _ in range(2):
            got = calls(*frozen[0], *frozen[1:])
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("d,causal,seq", [(64, True, 1024), (128, False, 700)],
                         ids=["d64-causal", "d128-ragged"])
def test_sm90_key_mask_plans_repeat_the_launch_with_new_masks(d, causal, seq, monkeypatch):
    """A masked call like an earlier one (shapes, strides, alignment, the mask view's too)
    repeats the forward and fused backward through their plans with its own tensors and mask:
    output, lse, dK and dV bitwise those of the full launch path (outputs poisoned, plans
    off), dQ within 3x PyTorch's same-dtype error of float64; the plans hold no tensor."""
    from flashtile.backends import triton as backend

    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "_fwd_plans", type(launch_sm90._fwd_plans)())
    monkeypatch.setattr(launch_sm90, "_bwd_plans", type(launch_sm90._bwd_plans)())
    gen = torch.Generator().manual_seed(d)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0 if causal else -1)

    def call(q, k, v, do, mask):
        out, lse = backend.forward(q, k, v, spec, attn_bias=mask)
        return (out, lse, *backend.backward(do, q, k, v, out, lse.contiguous(), spec,
                                            attn_bias=mask))

    def inputs(kind):
        return [torch.randn(2, seq, 4, d, device="cuda", dtype=torch.bfloat16)
                for _ in range(4)] + [_mask(kind, 2, seq, gen)]

    call(*inputs("left"))  # compiled, launched directly: leaves the plans
    call(*inputs("left"))
    for plans in (launch_sm90._fwd_plans, launch_sm90._bwd_plans):
        (plan,) = plans._plans.values()
        assert not any(isinstance(x, torch.Tensor) or hasattr(x, "base") for x in plan.values)
    used = _spy(monkeypatch, "planned_forward"), _spy(monkeypatch, "planned_backward")
    new = inputs("holes")  # the same signature, other contents
    planned = call(*new)
    assert all(len(c) == 1 for c in used)
    with poison_outputs():
        full = call(*new)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), planned, full):
        if name != "dq":
            assert torch.equal(a, b), name
    assert _dq_within_rule(planned[2], *new, causal)


@pytest.mark.parametrize("lq,lk,causal", [(512, 512, True), (384, 640, False), (384, 640, True),
                                          (640, 384, True)],
                         ids=["causal-L=S", "full-L<S", "causal-L<S", "causal-L>S"])
def test_sm90_sdpa_drop_in_alignment(lq, lk, causal, monkeypatch):
    """The SDPA drop-in's top-left ``is_causal`` takes the Hopper kernels exactly where it is
    the bottom-right rule they implement (L == S, or no mask at all), the Triton kernels
    elsewhere; output and gradients (GQA) within 2x / 3x PyTorch's fp16 error of float64."""
    gen = torch.Generator().manual_seed(lq + lk)
    q = torch.randn(2, 4, lq, 64, generator=gen).cuda().half()
    k, v, = (torch.randn(2, 2, lk, 64, generator=gen).cuda().half() for _ in range(2))
    do = torch.randn(2, 4, lq, 64, generator=gen).cuda().half()
    fwd, bwd = _spy(monkeypatch, "forward"), _spy(monkeypatch, "fused_backward")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kw = dict(is_causal=causal, enable_gqa=True)

    def run(fn, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, **kw)
        return [out, *torch.autograd.grad(out, leaves, do.to(dtype))]

    got = run(flashtile.scaled_dot_product_attention, torch.float16)
    hopper = not causal or lq == lk
    assert len(fwd) == int(hopper) and len(bwd) == int(hopper and launch_sm90.fused_pays(
        lq, lk, causal, 64))
    ref, low = run(sdpa, torch.float64), run(sdpa, torch.float16)
    for name, g, r, lo, rule in zip(("out", "dq", "dk", "dv"), got, ref, low, (2, 3, 3, 3)):
        err = (g.double() - r).abs().max().item()
        base = (lo.double() - r).abs().max().item()
        assert torch.isfinite(g).all() and err <= rule * base + 1e-4, (name, err, base)
