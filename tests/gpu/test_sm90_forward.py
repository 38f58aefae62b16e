"""The Hopper (Gluon) forward and backward kernels against a float64 reference, flash-attn's
error rule, and the portable Triton kernels; skipped without an sm_90 GPU."""
import pytest
import torch

import flashtile
from flashtile.backends.triton import launch_bwd, launch_sm90
from flashtile.backends.triton.fastlaunch import poison_outputs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")


def _reference(q, k, v, causal, dtype, window=(-1, -1), scale=None):
    """Attention of (B, S, H, D) inputs in ``dtype`` (bottom-right causal, or the bottom-right
    ``window`` (left, right), -1 for no edge; ``scale``: 1/sqrt(D) unless given), with its
    lse."""
    qh, kh, vh = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = (qh @ kh.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    left, right = window[0], 0 if causal else window[1]
    if left >= 0 or right >= 0:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        if right >= 0:
            s = s.masked_fill(j > i + sk - sq + right, float("-inf"))
        if left >= 0:
            s = s.masked_fill(j < i + sk - sq - left, float("-inf"))
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, -1)
    return (torch.softmax(s, -1) @ vh).transpose(1, 2), lse


CASES = [  # (batch, sq, sk, heads, heads_k, d, causal)
    ("d128", 2, 256, 256, 4, 4, 128, False),
    ("d128-causal", 2, 384, 384, 4, 4, 128, True),
    ("d64-gqa", 1, 256, 512, 8, 2, 64, False),
    ("d64-causal-sk>sq", 2, 128, 512, 4, 4, 64, True),
    ("d128-long-causal", 1, 2048, 2048, 2, 1, 128, True),
    # d = 64 causal: one consumer in two CTAs an SM up to ~768 keys a row on average (the
    # cases above with 128-1024 keys), two consumers beyond
    ("d64-long-causal", 1, 2048, 2048, 4, 2, 64, True),
    # more work items than SMs: each CTA of the persistent grid takes several, the last round
    # only some CTAs (barrier phases carried across items, the snake order, causal lengths)
    ("d64-causal-rounds", 4, 1024, 1024, 9, 3, 64, True),
    ("d128-rounds", 3, 768, 1152, 23, 23, 128, False),
    # d = 256 takes tiles of 64 keys
    ("d256", 2, 256, 256, 4, 4, 256, False),
    ("d256-gqa-causal-sk>sq", 1, 256, 320, 4, 2, 256, True),
    ("d256-causal-rounds", 2, 1024, 1024, 40, 8, 256, True),
    # from attn_fwd_sm90.PLAIN_KEYS keys on, the tiles below the diagonal in a loop without
    # the mask (bottom-right: the diagonal shifted by sk - sq)
    ("d256-long-causal-sk>sq", 1, 1536, 2560, 4, 2, 256, True),
    ("d128-long-causal-sk>sq", 1, 1024, 3072, 4, 4, 128, True),
    # lengths that are not multiples of the tiles: 3-D descriptors, the rows past a sequence
    # read as zeros and not written, the keys past it masked in the first tile walked
    ("d128-ragged", 2, 200, 333, 4, 4, 128, False),
    ("d128-causal-ragged", 2, 300, 300, 4, 4, 128, True),
    ("d64-ragged", 3, 1000, 1000, 4, 4, 64, False),
    ("d64-causal-ragged-sk>sq", 2, 77, 1001, 4, 2, 64, True),
    ("d64-long-causal-ragged", 1, 2047, 2047, 4, 2, 64, True),
    ("d256-causal-ragged", 1, 250, 250, 4, 4, 256, True),
    ("d64-one-row", 2, 1, 5, 2, 2, 64, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_forward_matches_float64_reference(case, dtype, monkeypatch):
    _, batch, sq, sk, heads, heads_k, d, causal = case
    monkeypatch.setenv("FLASHTILE_SM90", "1")
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5,
                                            window_right=0 if causal else -1)
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


WINDOW_CASES = [  # (batch, sq, sk, heads, heads_k, d, window_left, window_right)
    ("d128-local", 2, 512, 512, 4, 4, 128, 100, 0),
    # only the diagonal: most rows see no key in the first tiles of their block
    ("d64-diagonal-gqa", 1, 384, 384, 4, 2, 64, 0, 0),
    ("d64-band-sk>sq", 2, 256, 640, 4, 4, 64, 150, 37),
    ("d128-left-only-sk>sq", 1, 256, 512, 2, 2, 128, 200, -1),
    ("d128-right-only", 1, 384, 384, 2, 2, 128, -1, 64),
    ("d256-local", 1, 512, 512, 4, 4, 256, 70, 0),
    # more work items than SMs, windows wider than a tile
    ("d128-local-rounds", 3, 1024, 1024, 23, 23, 128, 300, 0),
    # a right edge past the diagonal reaches the keys past the end (masked) at lengths that
    # are not multiples of the tiles
    ("d128-band-ragged", 2, 300, 457, 4, 4, 128, 150, 37),
    # from attn_fwd_sm90.PLAIN_KEYS keys on: windows whose lower edge cuts the first tiles
    # (then one loop with the mask, as below it) or not (the tiles between in the loop
    # without it), and a left edge alone
    ("d128-long-local", 1, 2048, 2048, 4, 4, 128, 300, 0),
    ("d64-long-band-sk>sq", 1, 2048, 3072, 4, 2, 64, 700, 50),
    ("d256-long-left-only", 1, 1024, 2560, 2, 2, 256, 1500, -1),
    ("d128-long-right-only", 1, 2048, 2048, 2, 2, 128, -1, 300),
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=[c[0] for c in WINDOW_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_forward_with_a_window_matches_float64_reference(case, dtype, monkeypatch):
    """Sliding windows (bottom-right, either edge or both) take the Hopper forward, whose block
    walks only the key tiles its rows see: output within 2x PyTorch's same-dtype error of
    float64, lse within 1e-3, the public function equal to the direct launch."""
    _, batch, sq, sk, heads, heads_k, d, left, right = case
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5, window_left=left,
                                            window_right=right)
    assert launch_sm90.eligible(q, k, v, spec)
    with poison_outputs():
        out, lse = launch_sm90.forward(q, k, v, spec)
    ref, ref_lse = _reference(q, k, v, False, torch.float64, (left, right))
    low, _ = _reference(q, k, v, False, dtype, (left, right))
    err = (out.double() - ref).abs().max().item()
    base = (low.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= 2 * base + 1e-4, (err, base)
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3
    assert torch.equal(flashtile.flash_attn_func(q, k, v, window_size=(left, right)), out)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seq", [512, 500], ids=["aligned", "ragged"])
@pytest.mark.parametrize("d", [128, 96, 192])
def test_sm90_forward_cuda_graph_replay_equals_eager(causal, seq, d):
    """The persistent grid and the tensor descriptors made per call replay correctly from a
    CUDA graph on new inputs copied into the captured buffers (3-D descriptors at a length
    that is not a multiple of the tiles; at d = 96 / 192 the padded head dims' views, tiles
    past each head's last column)."""
    shape = (2, seq, 4, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flashtile.flash_attn_func(q, k, v, causal=causal)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flashtile.flash_attn_func(q, k, v, causal=causal))


def test_sm90_forward_under_compile_fullgraph_dynamic():
    """``torch.compile(fullgraph=True, dynamic=True)`` runs the same kernel as eager calls."""
    fn = torch.compile(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True),
                       fullgraph=True, dynamic=True)
    for n in (256, 640, 300):  # (300: not a multiple of the tiles, 3-D descriptors)
        q, k, v = (torch.randn(2, n, 4, 64, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        assert torch.equal(fn(q, k, v), flashtile.flash_attn_func(q, k, v, causal=True))


COMPILE_CASES = [  # (d, causal, lengths, layout)
    ("d64-causal", 64, True, (256, 640, 300), "contiguous"),
    ("d128-causal", 128, True, (256, 640, 300), "contiguous"),
    ("d128", 128, False, (256, 640, 300), "contiguous"),
    ("d256", 256, False, (256, 640, 300), "contiguous"),
    ("d256-causal", 256, True, (256, 640, 300), "contiguous"),
    # padded head dims at SDPA-layout inputs: the padded forward, the portable backward or,
    # from PAD_VIEW_KEYS keys, the Hopper backward through views of the next width
    ("d96-sdpa-causal", 96, True, (300, 364), "sdpa"),
    ("d96-sdpa-causal-long-keys", 96, True, (4096, 4160), "sdpa"),
    ("d192-sdpa-causal", 192, True, (333, 397), "sdpa"),
]


@pytest.mark.parametrize("case", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_sm90_backward_under_compile_fullgraph_dynamic_equals_eager(case, monkeypatch):
    """The forward compiled with ``fullgraph=True, dynamic=True`` and the backward AOTAutograd
    builds for it, over lengths multiples of the tiles and not, run the Hopper kernels of eager
    calls: output, dK and dV bitwise, dQ within one bfloat16 rounding (the one-kernel backward
    adds it up with float32 atomics in no fixed order)."""
    _, d, causal, lengths, layout = case
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    fn = torch.compile(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal),
                       fullgraph=True, dynamic=True)
    for n in lengths:
        q, k, v = (_in_layout(torch.randn(2, n, 4, d, device="cuda", dtype=torch.bfloat16),
                              layout).requires_grad_() for _ in range(3))
        do = torch.randn(2, n, 4, d, device="cuda", dtype=torch.bfloat16)
        out = fn(q, k, v)
        got = torch.autograd.grad(out, (q, k, v), do)
        want_out = flashtile.flash_attn_func(q, k, v, causal=causal)
        want = torch.autograd.grad(want_out, (q, k, v), do)
        assert torch.equal(out, want_out)
        torch.testing.assert_close(got[0], want[0])
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (256, True)],
                         ids=["d64-causal", "d128", "d256-causal"])
def test_sm90_ragged_backward_cuda_graph_replay_equals_eager(d, causal):
    """The backward at a length that is not a multiple of the tiles (its padded lse and delta,
    the 3-D descriptors, the persistent counter at d = 64) replays from a CUDA graph on new
    inputs: dK, dV bitwise those of an eager call, dQ within the accumulator's order."""
    from flashtile.backends import triton as backend

    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5,
                                            window_right=0 if causal else -1)
    q, k, v, do = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    out, lse = backend.forward(q, k, v, spec)
    lse = lse.contiguous()
    backend.backward(do, q, k, v, out, lse, spec)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm the plan on the capture's stream
        backend.backward(do, q, k, v, out, lse, spec)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = backend.backward(do, q, k, v, out, lse, spec)
    new_q, new_k, new_v, new_do = (torch.randn_like(x) for x in (q, k, v, do))
    new_out, new_lse = backend.forward(new_q, new_k, new_v, spec)
    for x, y in ((q, new_q), (k, new_k), (v, new_v), (do, new_do), (out, new_out),
                 (lse, new_lse)):
        x.copy_(y)
    for g in grads:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = backend.backward(new_do, new_q, new_k, new_v, new_out, new_lse.contiguous(), spec)
    assert torch.equal(grads[1], eager[1]) and torch.equal(grads[2], eager[2])
    ref = _grads(new_q, new_k, new_v, new_do, causal, torch.float64)[1]
    low = _grads(new_q, new_k, new_v, new_do, causal, torch.bfloat16)[1]
    base = (low.double() - ref).abs().max().item()
    assert (grads[0].double() - ref).abs().max().item() <= 3 * base + 1e-4


def test_sm90_forward_is_the_default_and_can_be_turned_off(monkeypatch):
    q = torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=0.125)
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    assert launch_sm90.eligible(q, q, q, spec)
    monkeypatch.setenv("FLASHTILE_SM90", "0")
    assert not launch_sm90.eligible(q, q, q, spec)


def test_sm90_forward_misaligned_input_takes_the_portable_kernel():
    """TMA reads 16-byte aligned addresses only: a contiguous view 2 bytes into its storage is
    not eligible and is computed, correctly, by the Triton kernel."""
    shape = (2, 256, 2, 64)
    buf = torch.randn(torch.Size(shape).numel() + 1, device="cuda", dtype=torch.bfloat16)
    q = buf[1:].view(shape)
    assert q.is_contiguous() and q.data_ptr() % 16
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=shape[-1] ** -0.5)
    assert not launch_sm90.eligible(q, q, q, spec)
    ref, _ = _reference(q, q, q, False, torch.float64)
    low, _ = _reference(q, q, q, False, torch.bfloat16)
    err = (flashtile.flash_attn_func(q, q, q).double() - ref).abs().max().item()
    assert err <= 2 * (low.double() - ref).abs().max().item() + 1e-4


def test_sm90_forward_direct_launch_equals_first_launch():
    """After its first call a variant is launched past ``JITFunction.run``; both launches
    compute the same bits on the same inputs, and a new input of the same variant is right."""
    launch_sm90._compiled.clear()
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=0.125, window_right=0)
    q, k, v = (torch.randn(2, 384, 3, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    first, first_lse = launch_sm90.forward(q, k, v, spec)
    assert len(launch_sm90._compiled) == 1
    with poison_outputs():
        again, again_lse = launch_sm90.forward(q, k, v, spec)
    assert torch.equal(first, again) and torch.equal(first_lse, again_lse)
    q2 = torch.randn_like(q)
    out, _ = launch_sm90.forward(q2, k, v, spec)
    ref, _ = _reference(q2, k, v, True, torch.float64)
    low, _ = _reference(q2, k, v, True, torch.float16)
    base = (low.double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * base + 1e-4


@pytest.mark.parametrize("seq", [384, 300], ids=["aligned", "ragged"])
def test_sm90_forward_plan_repeats_the_launch_with_the_new_tensors(seq, monkeypatch):
    """A call with the shapes, strides and alignment of an earlier direct launch (and its dtype,
    device and spec) repeats it through a plan with its own tensors: bitwise the output of the
    full launch path on the same inputs (whose outputs start as NaN); another stride, another
    spec or the switch turned off find no plan."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "_fwd_plans", type(launch_sm90._fwd_plans)())
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=0.125, window_right=0)
    q, k, v = (torch.randn(2, seq, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert launch_sm90.planned_forward(q, k, v, spec) is None
    launch_sm90.forward(q, k, v, spec)  # compiled (or found compiled), then launched directly
    launch_sm90.forward(q, k, v, spec)
    # the plan holds no tensor (nor a descriptor of one) of the call it was made from
    (plan,) = launch_sm90._fwd_plans._plans.values()
    assert not any(isinstance(x, torch.Tensor) or hasattr(x, "base") for x in plan.values)
    # replays go through fastlaunch.TmaLaunch (each descriptor encoded once per address; the
    # replays below on the same tensors reuse the encodings)
    assert plan.fast is not None
    q2, k2, v2 = (torch.randn_like(x) for x in (q, k, v))
    planned = launch_sm90.planned_forward(q2, k2, v2, spec)
    assert planned is not None
    with poison_outputs():  # (plans are off while outputs are poisoned)
        assert launch_sm90.planned_forward(q2, k2, v2, spec) is None
        full = launch_sm90.forward(q2, k2, v2, spec)
    assert torch.equal(planned[0], full[0]) and torch.equal(planned[1], full[1])
    # the public function takes the plan: same bits again (the same tensors: the encodings reused)
    assert torch.equal(flashtile.flash_attn_func(q2, k2, v2, softmax_scale=0.125, causal=True),
                       full[0])
    assert launch_sm90.planned_forward(q2, k2, v2, flashtile.backends.spec.AttnSpec(
        softmax_scale=0.125)) is None
    assert launch_sm90.planned_forward(q2.transpose(1, 2).contiguous().transpose(1, 2), k2, v2,
                                       spec) is None
    monkeypatch.setenv("FLASHTILE_SM90", "0")
    assert launch_sm90.planned_forward(q2, k2, v2, spec) is None


def _backward_inputs(seq: int, d: int, spec):
    """Fresh bf16 ``(2, seq, 4, d)`` q, k, v, dO and the Hopper backend's forward of them:
    ``(do, q, k, v, out, lse)`` as ``backward`` takes them (lse contiguous)."""
    from flashtile.backends import triton as backend

    q, k, v, do = (torch.randn(2, seq, 4, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    out, lse = backend.forward(q, k, v, spec)
    return do, q, k, v, out, lse.contiguous()


@pytest.mark.parametrize("d,causal,deterministic", [(256, False, False), (256, True, True),
                                                    (128, True, True), (128, False, True),
                                                    (64, True, True)],
                         ids=["d256-gluon-dq", "d256-causal-deterministic",
                              "d128-causal-deterministic", "d128-deterministic",
                              "d64-causal-deterministic-persistent"])
def test_sm90_two_kernel_backward_replays_a_plan_bitwise(d, causal, deterministic, monkeypatch):
    """The two-kernel Hopper backward (at d = 256 delta, the Gluon dQ kernel and the dK/dV
    kernel; at d = 128 and 64 the Triton dQ kernel and the dK/dV kernel, persistent at d = 64
    with a work counter that a replay zeroes) records one launch plan per signature, holding
    neither a tensor nor a descriptor of the recording call, and later calls
    replay it: gradients bitwise those of the full path (no kernel sums in a varying order).
    Turning a Hopper switch (``FLASHTILE_SM90_DQ=0``, ``FLASHTILE_SM90=0``) finds no plan of
    the other setting: the full path runs and records its own."""
    from flashtile.backends import triton as backend
    from flashtile.backends.triton import launch_bwd
    from flashtile.backends.triton.fastlaunch import PlanCache

    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.delenv("FLASHTILE_SM90_DQ", raising=False)
    monkeypatch.setattr(launch_bwd, "_plans", PlanCache())
    seq = 512
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5,
                                            window_right=0 if causal else -1,
                                            deterministic=deterministic)

    def inputs():
        return _backward_inputs(seq, d, spec)

    full_calls = []
    real = launch_bwd._backward
    monkeypatch.setattr(launch_bwd, "_backward", lambda *a, **kw: full_calls.append(1) or real(
        *a, **kw))
    do, q, k, v, out, lse = inputs()
    backend.backward(do, q, k, v, out, lse, spec)  # compiled (or found), then launched directly
    backend.backward(do, q, k, v, out, lse, spec)
    (plan,) = launch_bwd._plans._plans.values()
    assert not any(isinstance(x, torch.Tensor) or hasattr(x, "base")
                   for _, template, _, _ in plan.launches for x in template)
    # the Gluon launches' descriptors are rebuilt per replay, through fastlaunch.TmaLaunch
    # (each encoded once per address)
    assert any(len(slot) == 4 for _, _, slots, _ in plan.launches for slot in slots)
    assert all(tma == any(len(slot) == 4 for slot in slots)
               for _, _, slots, tma in plan.launches)
    do, q, k, v, out, lse = inputs()
    full_calls.clear()
    planned = backend.backward(do, q, k, v, out, lse, spec)
    assert full_calls == []
    with poison_outputs():  # (plans are off while outputs are poisoned)
        full = real(do, q, k, v, out, lse, spec)
    for g, f in zip(planned, full):
        assert torch.isfinite(g).all() and torch.equal(g, f)
    for name in ("FLASHTILE_SM90_DQ", "FLASHTILE_SM90"):
        monkeypatch.setenv(name, "0")
        full_calls.clear()
        other = backend.backward(do, q, k, v, out, lse, spec)
        assert full_calls == [1], name
        # another dQ kernel (d = 256) or the Triton kernels: float32 sums in another order,
        # rounded to bf16 (units of 2^-8 to 2^-7 relative) a unit or two apart
        for g, f in zip(other, full):
            torch.testing.assert_close(g, f, rtol=2 ** -6, atol=2e-3)


@pytest.mark.parametrize("d,causal,seq", [(64, True, 384), (128, False, 384), (128, False, 300)],
                         ids=["d64-causal-persistent", "d128-full", "d128-full-ragged"])
def test_sm90_backward_plan_repeats_the_launch_with_the_new_tensors(d, causal, seq, monkeypatch):
    """A backward with the shapes, strides and alignment of an earlier direct launch of the
    fused kernel (and its dtype, device, spec and chunk setting) repeats it through a plan with
    its own tensors: dK and dV bitwise those of the full path on the same inputs (whose outputs
    start as NaN), dQ within the accumulator's summation order; the plan holds no tensor;
    another spec, deterministic=True or the switch turned off find no plan."""
    from flashtile.backends import triton as backend
    from flashtile.backends.triton import launch_bwd

    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "_bwd_plans", type(launch_sm90._bwd_plans)())
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=0.125, window_right=0 if causal else -1)
    setting = launch_bwd._chunk_env()

    def inputs():
        return _backward_inputs(seq, d, spec)

    do, q, k, v, out, lse = inputs()
    assert launch_sm90.planned_backward(q, k, v, out, do, lse, spec, setting) is None
    backend.backward(do, q, k, v, out, lse, spec)  # compiled (or found), then launched directly
    backend.backward(do, q, k, v, out, lse, spec)
    (plan,) = launch_sm90._bwd_plans._plans.values()
    assert not any(isinstance(x, torch.Tensor) or hasattr(x, "base") for x in plan.values)
    # replays go through fastlaunch.TmaLaunch (each descriptor encoded once per address; the
    # replays below on the same tensors reuse the encodings), the prologue through its bound
    # direct launch (fastlaunch.BoundLaunch)
    assert plan.fast is not None and plan.prologue is not None
    do, q, k, v, out, lse = inputs()
    planned = launch_sm90.planned_backward(q, k, v, out, do, lse, spec, setting)
    assert planned is not None
    with poison_outputs():  # (plans are off while outputs are poisoned)
        assert launch_sm90.planned_backward(q, k, v, out, do, lse, spec, setting) is None
        full = launch_bwd._backward(do, q, k, v, out, lse, spec)
    assert all(torch.isfinite(g).all() for g in planned)
    assert torch.equal(planned[1], full[1]) and torch.equal(planned[2], full[2])
    # a float32 sum in another order rounds to bf16 at most one unit (2^-7) apart
    torch.testing.assert_close(planned[0], full[0], rtol=2 ** -7, atol=1e-3)
    # the backend's backward takes the plan: dK and dV bitwise again
    again = backend.backward(do, q, k, v, out, lse, spec)
    assert torch.equal(again[1], full[1]) and torch.equal(again[2], full[2])
    other = flashtile.backends.spec.AttnSpec(softmax_scale=0.125, window_right=-1 if causal else 0)
    assert launch_sm90.planned_backward(q, k, v, out, do, lse, other, setting) is None
    calls = []
    real = launch_sm90.planned_backward
    monkeypatch.setattr(launch_sm90, "planned_backward", lambda *a: calls.append(1))
    backend.backward(do, q, k, v, out, lse, flashtile.backends.spec.AttnSpec(
        softmax_scale=0.125, window_right=0 if causal else -1, deterministic=True))
    assert calls == []  # deterministic=True never asks for the fused kernel's plan
    monkeypatch.setattr(launch_sm90, "planned_backward", real)
    monkeypatch.setenv("FLASHTILE_SM90", "0")
    assert launch_sm90.planned_backward(q, k, v, out, do, lse, spec, setting) is None


def _grads(q, k, v, do, causal, dtype, window=(-1, -1)):
    """(out, dq, dk, dv) of attention in ``dtype`` through autograd (bottom-right causal or
    ``window``)."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, _ = _reference(*leaves, causal, dtype, window)
    out.backward(do.to(dtype))
    return [out] + [x.grad for x in leaves]


BWD_CASES = [  # (batch, sq, sk, heads, heads_k, d, causal)
    ("d128", 2, 192, 256, 4, 4, 128, False),
    ("d128-causal-gqa", 1, 1152, 1152, 4, 2, 128, True),
    ("d64", 2, 320, 640, 3, 3, 64, False),
    ("d64-causal-sk>sq", 2, 128, 1280, 3, 3, 64, True),
    ("d64-long-causal-gqa", 1, 2048, 2048, 2, 1, 64, True),
    # more CTAs than SMs, several heads a CTA (GQA) and one query tile per CTA (sq = 64)
    ("d128-many-ctas-gqa", 3, 64, 2048, 12, 3, 128, False),
    # d = 64 runs persistent: more work items (144) than SMs, so a CTA takes several
    ("d64-many-items-gqa", 3, 512, 2048, 12, 3, 64, False),
    # d = 128 causal at a short length: the fused kernel (fused_pays)
    ("d128-short-causal", 1, 384, 384, 4, 2, 128, True),
    # d = 64 up to 512 keys without masking: the two kernels as well
    ("d64-short", 2, 256, 512, 2, 2, 64, False),
    # d = 64 causal: the fused kernel at every length
    ("d64-short-causal", 2, 384, 384, 4, 2, 64, True),
    # lengths that are not multiples of the tiles (3-D descriptors, lse and delta padded)
    ("d128-ragged", 2, 200, 333, 4, 4, 128, False),
    ("d128-causal-ragged-gqa", 2, 1100, 1100, 4, 2, 128, True),
    ("d64-ragged", 2, 700, 900, 3, 3, 64, False),
    ("d64-causal-ragged-gqa", 2, 999, 999, 4, 2, 64, True),
    # d = 256: 64-key items shared by both consumers, dQ reduced a quarter tile at a time
    ("d256", 2, 192, 256, 4, 4, 256, False),
    ("d256-causal-gqa", 1, 1152, 1152, 4, 2, 256, True),
    ("d256-many-items-gqa", 3, 64, 2048, 12, 3, 256, False),
    ("d256-ragged", 2, 200, 333, 4, 4, 256, False),
    ("d256-causal-ragged-gqa", 2, 1100, 1100, 4, 2, 256, True),
]


@pytest.mark.parametrize("case", BWD_CASES, ids=[c[0] for c in BWD_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_sm90_backward_matches_float64_reference(case, dtype, deterministic, monkeypatch):
    """dQ, dK and dV of the Hopper backward within 3x PyTorch's same-dtype error of float64
    (flash-attn's rule for gradients): by default the fused kernel (dQ added by TMA
    reductions; at d = 64 without masking up to 512 keys, and with ``deterministic=True``, the
    Triton dQ kernel and the Gluon dK/dV kernel, whose gradients are bitwise equal from one
    call to the next; d = 256: ``launch_sm90.fused_pays``).  dQ
    as with the Hopper kernels off, within rounding."""
    _, batch, sq, sk, heads, heads_k, d, causal = case
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    do = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5,
                                            window_right=0 if causal else -1)
    eligible = launch_sm90.bwd_eligible(q, k, v, do, torch.empty_like(k), torch.empty_like(v),
                                        spec, deterministic)
    assert eligible == (not deterministic or causal or d >= 128)
    fused_calls = []
    real = launch_sm90.fused_backward
    # (no plan of an earlier test's call: each backward here takes the full path)
    monkeypatch.setattr(launch_sm90, "_bwd_plans", type(launch_sm90._bwd_plans)())
    monkeypatch.setattr(launch_sm90, "fused_backward",
                        lambda *a: fused_calls.append(1) or real(*a))

    def grads():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with poison_outputs():
            flashtile.flash_attn_func(*leaves, causal=causal,
                                      deterministic=deterministic).backward(do)
        return [x.grad for x in leaves]

    got = grads()
    assert len(fused_calls) == int(not deterministic and launch_sm90.fused_pays(sq, sk, causal, d))
    ref = _grads(q, k, v, do, causal, torch.float64)[1:]
    low = _grads(q, k, v, do, causal, dtype)[1:]
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        err = (g.double() - r).abs().max().item()
        base = (lo.double() - r).abs().max().item()
        assert torch.isfinite(g).all() and err <= 3 * base + 1e-4, (name, err, base)
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(got, grads()))
    monkeypatch.setenv("FLASHTILE_SM90", "0")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flashtile.flash_attn_func(*leaves, causal=causal).backward(do)
    assert not launch_sm90.bwd_eligible(q, k, v, do, k, v, spec)
    # the forward differs with the switch (its lse too, in the last bits): dq within rounding
    assert (leaves[0].grad.double() - got[0].double()).abs().max().item() <= 3 * (
        (low[0].double() - ref[0]).abs().max().item()) + 1e-4


@pytest.mark.parametrize("n", [4096, 8192], ids=lambda n: f"n{n}")
def test_sm90_backward_of_gpt2_layout_at_long_context_matches_float64_reference(n, monkeypatch):
    """GPT-2 trained at 4K / 8K tokens: q, k and v as slices of one fused projection's rows
    (``3 * H * D`` values a token), causal, d = 64, bf16; the Hopper forward and fused
    backward read them in place, and dQ, dK, dV stay within 3x PyTorch's bf16 error of
    float64 (flash-attn's rule) over the whole causal triangle."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    heads, d = 2, 64
    qkv = torch.randn(1, n, 3 * heads * d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x.view(1, n, heads, d) for x in qkv.split(heads * d, dim=2))
    do = torch.randn(1, n, heads, d, device="cuda", dtype=torch.bfloat16)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5, window_right=0)
    assert launch_sm90.eligible(q, k, v, spec) and q.stride(1) == 3 * heads * d
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        flashtile.flash_attn_func(*leaves, causal=True).backward(do)
    ref = _grads(q, k, v, do, True, torch.float64)[1:]
    low = _grads(q, k, v, do, True, torch.bfloat16)[1:]
    for name, x, r, lo in zip(("dq", "dk", "dv"), leaves, ref, low):
        err = (x.grad.double() - r).abs().max().item()
        base = (lo.double() - r).abs().max().item()
        assert torch.isfinite(x.grad).all() and err <= 3 * base + 1e-4, (name, err, base)


@pytest.mark.parametrize("bh_group", [2, 3, 5], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_sm90_backward_group_order_gives_the_plain_orders_gradients(bh_group, deterministic,
                                                                    monkeypatch):
    """The backward's work items taken in groups of (batch, head) pairs (``_item_keys``; 7 * 2
    pairs, so the last group is partial; 224 items, more than SMs, so the persistent d = 64
    kernel's CTAs take several): every item is still one key block of one pair, so dK and dV
    are bitwise those of the plain order (each item owns its keys) and dQ equal within the
    float32 accumulator's summation order (bitwise with ``deterministic=True``)."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    q, do = (torch.randn(7, 2048, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    # GQA: an item walks both query heads of its key/value head
    k, v = (torch.randn(7, 2048, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def grads(group):
        monkeypatch.setattr(launch_sm90, "bwd_group", lambda *a: group)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with poison_outputs():
            flashtile.flash_attn_func(*leaves, causal=True,
                                      deterministic=deterministic).backward(do)
        return [x.grad for x in leaves]

    plain, grouped = grads(1), grads(bh_group)
    assert all(torch.isfinite(g).all() for g in grouped)
    assert torch.equal(plain[1], grouped[1]) and torch.equal(plain[2], grouped[2])
    if deterministic:
        assert torch.equal(plain[0], grouped[0])
    else:
        # a float32 sum in another order rounds to bf16 at most one unit (2^-7) apart
        torch.testing.assert_close(grouped[0], plain[0], rtol=2 ** -7, atol=1e-3)


def _launch_names(monkeypatch) -> list:
    """The names of the Hopper kernels launched from now on (``launch_sm90._launch``), in
    order."""
    names = []
    real = launch_sm90._launch
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, *a: names.append(name) or real(
        name, *a))
    return names


def _fwd_name(d: int) -> str:
    """The name of the Hopper forward kernel a head dim ``d`` launches: the split kernel for
    two tile widths (``FWD_SPLIT``), else the kernel of ``d``'s width."""
    return "fwd_split" if launch_sm90.FWD_SPLIT and launch_sm90.split_width(d) else "fwd"


def _dq_name(d: int) -> str:
    """The name of the dQ kernel of a head dim ``d``'s two-kernel backward at width 256: the
    split kernel for 128 and a smaller tile's width (``DQ_SPLIT``), else the kernel of 256."""
    return "dq_split" if launch_sm90.DQ_SPLIT and launch_sm90.split_width(d) == 128 else "dq"


def _bwd_name(d: int) -> str:
    """The name of the Hopper backward kernel of a head dim ``d`` on dense inputs (the fused
    kernel up to width 128, the dK/dV kernel of the two-kernel backward at 256): the split
    kernel for 64 and a smaller tile's width (``BWD128_SPLIT``: 80, 96) or 128 and a smaller
    one's (``BWD_SPLIT``: 144, 160, 192), else the kernel of the padded width."""
    first = launch_sm90.split_width(d)
    split = {64: launch_sm90.BWD128_SPLIT, 128: launch_sm90.BWD_SPLIT}.get(first, False)
    return "bwd_split" if split else "bwd"


def _in_layout(x, layout):
    """``x`` (B, S, H, D) as the same values in another memory layout a caller may hand in."""
    if layout == "contiguous":
        return x
    if layout == "sdpa":  # (B, H, S, D) contiguous, transposed back
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    batch, seq, heads, head_dim = x.shape  # a slice of a fused projection of 3 * H heads
    fused = torch.randn(batch, seq, 3 * heads, head_dim, device=x.device, dtype=x.dtype)
    fused[:, :, heads:2 * heads] = x
    return fused[:, :, heads:2 * heads]


@pytest.mark.parametrize("layout", ["sdpa", "fused-qkv"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
@pytest.mark.parametrize("seq", [1280, 1111], ids=["aligned", "ragged"])
def test_sm90_kernels_read_strided_layouts(layout, causal, deterministic, seq, monkeypatch):
    """q, k, v (and dO) in the SDPA layout or as slices of a fused QKV projection, as models
    hand them in, take the Hopper kernels (no copy) with outputs and gradients equal, within
    rounding of the float32 sums, to those of contiguous inputs, and within 3x PyTorch's
    same-dtype error of float64; at a length that is not a multiple of the tiles as well
    (3-D descriptors over the same strides)."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    batch, heads, heads_k, d = 2, 4, 2, 128
    q = torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seq, heads_k, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seq, heads_k, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16)
    names = _launch_names(monkeypatch)
    # no plan of an earlier call takes the forward past _launch
    monkeypatch.setattr(launch_sm90, "_fwd_plans", type(launch_sm90._fwd_plans)())

    def run(q, k, v, do):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with poison_outputs():
            out = flashtile.flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
            out.backward(do)
        return [out] + [x.grad for x in leaves]

    got = run(*(_in_layout(x, layout) for x in (q, k, v, do)))
    assert names == ["fwd", "bwd"], names
    dense = run(q, k, v, do)
    ref = _grads(q, k, v, do, causal, torch.float64)
    low = _grads(q, k, v, do, causal, torch.bfloat16)
    for name, g, c, r, lo in zip(("out", "dq", "dk", "dv"), got, dense, ref, low):
        base = (lo.double() - r).abs().max().item()
        assert (g.double() - r).abs().max().item() <= 3 * base + 1e-4, name
        assert (g.double() - c.double()).abs().max().item() <= 3 * base + 1e-4, name


def test_sm90_backward_follows_torch_deterministic_switch(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` selects the backward without atomics, as
    ``deterministic=True`` does."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    q, k, v, do = (torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    calls = []
    real = launch_sm90.fused_backward
    monkeypatch.setattr(launch_sm90, "_bwd_plans", type(launch_sm90._bwd_plans)())
    monkeypatch.setattr(launch_sm90, "fused_backward", lambda *a: calls.append(1) or real(*a))
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        flashtile.flash_attn_func(*leaves).backward(do)
    finally:
        torch.use_deterministic_algorithms(before)
    assert calls == []
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flashtile.flash_attn_func(*leaves).backward(do)
    assert calls == [1]


WG3_CASES = [  # (batch, sq, sk, heads, heads_k): d = 64, no mask (three consumers)
    ("one-partial-item", 2, 128, 128, 4, 4),
    ("exact-items", 2, 384, 384, 4, 4),
    ("partial-last-item", 2, 256, 512, 3, 1),
    ("gqa-sk<sq", 3, 640, 256, 6, 2),
    ("odd-heads-long", 1, 1152, 2048, 23, 23),
    ("many-rounds-partial", 8, 1024, 1024, 24, 24),  # ~9 items a CTA, every sixth partial
]


@pytest.mark.parametrize("case", WG3_CASES, ids=[c[0] for c in WG3_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_forward_three_consumers_match_float64_reference(case, dtype, monkeypatch):
    """d = 64 without masking runs three consumer warpgroups (192-row work items; a
    sequence's last item may hold fewer rows, whose consumers store nothing): output within
    2x PyTorch's same-dtype error of float64 and lse within 1e-3 on every row (the outputs
    start as NaN, so a row no consumer stored fails)."""
    _, batch, sq, sk, heads, heads_k = case
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    assert launch_sm90.consumers(64, False) == 3
    q = torch.randn(batch, sq, heads, 64, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, 64, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, 64, device="cuda", dtype=dtype)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=0.125)
    assert launch_sm90.eligible(q, k, v, spec)
    with poison_outputs():
        out, lse = launch_sm90.forward(q, k, v, spec)
    ref, ref_lse = _reference(q, k, v, False, torch.float64)
    low, _ = _reference(q, k, v, False, dtype)
    base = (low.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max().item() <= 2 * base + 1e-4
    assert torch.isfinite(lse).all() and (lse.double() - ref_lse).abs().max().item() <= 1e-3


MOVING_CASES = [  # (head dim, the keys' scale along the sequence, softmax_scale)
    ("d256-growing", 256, "growing", None),
    ("d256-shrinking", 256, "shrinking", None),
    ("d256-late-jump", 256, "jump", None),
    ("d256-small-scale", 256, "growing", 0.01),
    ("d128-growing", 128, "growing", None),
]


def _moving_inputs(d: int, profile: str, dtype):
    """q, k, v (2, 2048, 4, d) with the keys scaled along the sequence by ``profile``."""
    batch, n, heads = 2, 2048, 4
    ramp = {"growing": torch.linspace(1.0, 6.0, n), "shrinking": torch.linspace(6.0, 1.0, n),
            "jump": torch.cat([torch.ones(n - 64), torch.full((64,), 8.0)])}[profile]
    q, k, v = (torch.randn(batch, n, heads, d, device="cuda") for _ in range(3))
    k = k * ramp.to("cuda")[None, :, None, None]
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("case", MOVING_CASES, ids=[c[0] for c in MOVING_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_forward_with_maxima_moving_along_the_keys_matches_float64_reference(case, dtype,
                                                                                   monkeypatch):
    """Row maxima that move late in a walk, so that the accumulator's rescale matters on late
    tiles (at d = 256 it runs at the start of the next step, ``kernels/attn_fwd_sm90``'s
    ``DEFER``): keys whose scale grows 6x along the sequence (the maxima move many times),
    shrinks 6x (set by the first tiles), or jumps 8x on the last 64 keys; a small scale.
    Output within 2x PyTorch's same-dtype error of float64, lse within 1e-3, equal to the
    public function's."""
    _, d, profile, scale = case
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    q, k, v = _moving_inputs(d, profile, dtype)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5 if scale is None else scale)
    assert launch_sm90.eligible(q, k, v, spec)
    with poison_outputs():
        out, lse = launch_sm90.forward(q, k, v, spec)
    ref, ref_lse = _reference(q, k, v, False, torch.float64, scale=scale)
    low, _ = _reference(q, k, v, False, dtype, scale=scale)
    base = (low.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max().item() <= 2 * base + 1e-4
    assert torch.isfinite(lse).all() and (lse.double() - ref_lse).abs().max().item() <= 1e-3
    assert torch.equal(flashtile.flash_attn_func(q, k, v, softmax_scale=scale), out)


@pytest.mark.parametrize("scale", [-0.04, 0.0], ids=["negative", "zero"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_forward_with_a_scale_not_above_zero_takes_the_portable_kernel(scale, d, dtype,
                                                                             monkeypatch):
    """The Hopper forward takes its row maxima of the raw scores q.k and folds the scale into
    exp2; with a negative scale those maxima bound nothing (exponents up to ~2^40 here: the
    Hopper kernel launched directly gives inf) and with 0 the first tile's alpha is exp2(-inf * 0),
    so such calls take the portable kernels, whose maxima are of the scaled scores: output
    within 2x PyTorch's same-dtype error of float64."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    q, k, v = _moving_inputs(d, "growing", dtype)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=scale)
    assert not launch_sm90.eligible(q, k, v, spec)
    out = flashtile.flash_attn_func(q, k, v, softmax_scale=scale)
    ref, _ = _reference(q, k, v, False, torch.float64, scale=scale)
    low, _ = _reference(q, k, v, False, dtype, scale=scale)
    base = (low.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max().item() <= 2 * base + 1e-4


def _check_windowed_d64_forward(case, dtype, n_consumers):
    """A d = 64 forward with the window of ``case`` (name, batch, sq, sk, heads, heads_k,
    window_left, window_right) on ``n_consumers`` consumer warpgroups (the launcher's choice):
    output within 2x PyTorch's same-dtype error of float64 and lse within 1e-3 on every row
    (outputs start as NaN), and the public call, through its launch plan on the second call,
    equal to it."""
    _, batch, sq, sk, heads, heads_k, left, right = case
    q = torch.randn(batch, sq, heads, 64, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, 64, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, 64, device="cuda", dtype=dtype)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=0.125, window_left=left,
                                            window_right=right)
    assert launch_sm90.eligible(q, k, v, spec)
    w = launch_sm90._window(spec, sq, sk)
    keys = launch_sm90._mean_keys(sq, sk, w["wl"], w["wr"])
    assert launch_sm90.consumers(64, True, keys, False, sq, left >= 0) == n_consumers
    with poison_outputs():
        out, lse = launch_sm90.forward(q, k, v, spec)
    ref, ref_lse = _reference(q, k, v, False, torch.float64, (left, right))
    low, _ = _reference(q, k, v, False, dtype, (left, right))
    base = (low.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max().item() <= 2 * base + 1e-4
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3
    for _ in range(2):  # the first call records the plan, the second replays it
        got = flashtile.flash_attn_func(q, k, v, window_size=(left, right))
        assert torch.equal(got, out)


ONE_CASES = [  # (batch, sq, sk, heads, heads_k, window_left, window_right): d = 64, one consumer
    ("causal-rounds-gqa", 4, 1024, 1024, 9, 3, -1, 0),
    ("causal-ragged-sk>sq", 2, 77, 500, 4, 2, -1, 0),
    ("causal-ragged", 3, 1000, 1000, 4, 4, -1, 0),
    ("causal-1536", 2, 1536, 1536, 4, 4, -1, 0),
    ("diagonal-gqa", 1, 384, 384, 4, 2, 0, 0),
    ("band-sk>sq", 2, 256, 640, 4, 4, 150, 37),
    ("band-ragged", 2, 300, 457, 4, 4, 150, 37),
]


@pytest.mark.parametrize("case", ONE_CASES, ids=[c[0] for c in ONE_CASES])
@pytest.mark.parametrize("ctas", [2, 3], ids=["two-ctas", "three-ctas"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_one_consumer_forward_matches_float64_reference(case, ctas, dtype, monkeypatch):
    """The one-consumer forward (d = 64 with masking over few keys) at two CTAs an SM (128-key
    tiles) and three (64-key tiles, ``launch_sm90.ONE_CONSUMER_CTAS``): output within 2x
    PyTorch's same-dtype error of float64 and lse within 1e-3 on every row (outputs start as
    NaN), and the public call, through its launch plan on the second call, equal to it."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "ONE_CONSUMER_CTAS", ctas)
    _check_windowed_d64_forward(case, dtype, 1)


WG3_MASKED_CASES = [  # (batch, sq, sk, heads, heads_k, window_left, window_right): d = 64
    ("causal-exact-items", 2, 384, 384, 4, 4, -1, 0),
    ("causal-first-item-a-third", 2, 256, 256, 4, 2, -1, 0),
    ("causal-gqa-first-item-a-third", 1, 640, 640, 6, 2, -1, 0),
    ("causal-sk>sq-two-loops", 1, 1280, 3072, 4, 4, -1, 0),
    ("causal-3k-two-loops", 2, 3072, 3072, 4, 4, -1, 0),
    ("right-edge-only-two-loops", 1, 2176, 2176, 4, 4, -1, 100),
    ("causal-many-rounds", 8, 1024, 1024, 24, 24, -1, 0),
]


@pytest.mark.parametrize("case", WG3_MASKED_CASES, ids=[c[0] for c in WG3_MASKED_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_three_consumer_causal_forward_matches_float64_reference(case, dtype,
                                                                      monkeypatch):
    """Three consumers with a window that has no lower edge (causal; the launcher's choice
    from ``THREE_CONSUMER_ROWS`` queries, lowered here to reach short sequences): row blocks
    laid from the sequence's end (a first block of 64 or 128 rows whose other consumers store
    nothing), the tiles an edge cuts all masked below ``PLAIN_KEYS`` keys or in a loop of
    their own from it: output within 2x PyTorch's same-dtype error of float64 and lse within
    1e-3 on every row (outputs start as NaN), and the public call, through its launch plan on
    the second call, equal to it."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "THREE_CONSUMER_ROWS", 0)
    monkeypatch.setattr(launch_sm90, "ONE_CONSUMER_KEYS", 0)
    _check_windowed_d64_forward(case, dtype, 3)


BWD_WINDOW_CASES = [  # (batch, sq, sk, heads, heads_k, d, window_left, window_right)
    ("d128-local-gqa", 1, 512, 512, 4, 2, 128, 100, 0),
    ("d64-band-sk>sq", 2, 256, 640, 2, 2, 64, 150, 37),
    # keys 0..835 are seen by no row: six CTAs walk no query tile (dK = dV = 0)
    ("d128-left-only-unreached-keys", 1, 128, 1024, 2, 2, 128, 60, -1),
    ("d64-diagonal", 1, 384, 384, 2, 1, 64, 0, 0),
    ("d64-band-ragged", 2, 250, 601, 2, 2, 64, 150, 37),
    ("d256-band-sk>sq", 2, 256, 640, 2, 2, 256, 150, 37),
]


@pytest.mark.parametrize("case", BWD_WINDOW_CASES, ids=[c[0] for c in BWD_WINDOW_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_sm90_backward_with_a_window_matches_float64_reference(case, dtype, deterministic,
                                                                monkeypatch):
    """Gradients of windowed attention through the Hopper backward (a CTA walks only the query
    tiles that see its keys, possibly none) within 3x PyTorch's same-dtype error of float64."""
    _, batch, sq, sk, heads, heads_k, d, left, right = case
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    do = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5, window_left=left,
                                            window_right=right)
    # the two kernels where asked for, or where the fused one does not pay (fused_pays)
    two = deterministic or not launch_sm90.fused_pays(sq, sk, spec.causal, d)
    eligible = launch_sm90.bwd_eligible(q, k, v, do, torch.empty_like(k), torch.empty_like(v),
                                        spec, two)
    assert eligible == (not two or d >= 128)
    names = _launch_names(monkeypatch)
    # no plan of an earlier call takes the forward past _launch
    monkeypatch.setattr(launch_sm90, "_fwd_plans", type(launch_sm90._fwd_plans)())
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        out = flashtile.flash_attn_func(*leaves, window_size=(left, right),
                                        deterministic=deterministic)
        out.backward(do)
    # the two kernels at d = 256: the Gluon dQ kernel, then the dK/dV kernel
    hopper = ["fwd", "dq", "bwd"] if two and launch_sm90.dq_eligible(d) else ["fwd", "bwd"]
    assert names == hopper if eligible else names == ["fwd"], names
    ref = _grads(q, k, v, do, False, torch.float64, (left, right))
    low = _grads(q, k, v, do, False, dtype, (left, right))
    for name, g, r, lo in zip(("out", "dq", "dk", "dv"), [out] + [x.grad for x in leaves],
                              ref, low):
        base = (lo.double() - r).abs().max().item()
        assert torch.isfinite(g).all(), name
        assert (g.double() - r).abs().max().item() <= 3 * base + 1e-4, name


@pytest.mark.parametrize("layout", ["contiguous", "sdpa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_sm90_ragged_lengths_keep_sequences_apart(layout, causal, deterministic, monkeypatch):
    """At lengths that are not multiples of the tiles the tiles of one sequence reach past its
    end: the kernels read zeros there (3-D descriptors), not the next sequence.  With batch
    entry 1 (contiguous layout: its rows follow entry 0's) or head 1 (SDPA layout: its rows
    follow head 0's) all NaN, entry / head 0's output and gradients are finite and within
    flash-attn's error rule of float64."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    batch, heads, sq, sk, d = 2, 2, 200, 333, 128

    def make(s):
        if layout == "contiguous":
            return torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16)
        return torch.randn(batch, heads, s, d, device="cuda",
                           dtype=torch.bfloat16).transpose(1, 2)
    q, k, v, do = make(sq), make(sk), make(sk), make(sq)
    poisoned = (slice(1, 2), slice(None)) if layout == "contiguous" else (slice(None),
                                                                         slice(None), slice(1, 2))
    for x in (q, k, v, do):
        x[poisoned] = float("nan")
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5,
                                            window_right=0 if causal else -1)
    assert launch_sm90.eligible(q, k, v, spec)
    assert launch_sm90.bwd_eligible(q, k, v, do, torch.empty_like(k), torch.empty_like(v), spec,
                                    deterministic)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        out = flashtile.flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
        out.backward(do)
    clean = (slice(0, 1), slice(None)) if layout == "contiguous" else (slice(None),
                                                                      slice(None), slice(0, 1))
    ref = _grads(*(x[clean] for x in (q, k, v, do)), causal, torch.float64)
    low = _grads(*(x[clean] for x in (q, k, v, do)), causal, torch.bfloat16)
    for name, g, r, lo in zip(("out", "dq", "dk", "dv"), [out] + [x.grad for x in leaves],
                              ref, low):
        g = g[clean]
        base = (lo.double() - r).abs().max().item()
        err = (g.double() - r).abs().max().item()
        assert torch.isfinite(g).all() and err <= 3 * base + 1e-4, (name, err, base)


DQ_CASES = [  # (batch, sq, sk, heads, heads_k, causal, layout), d = 256
    ("causal-gqa", 2, 1024, 1024, 4, 2, True, "contiguous"),
    ("sk-longer", 2, 512, 640, 4, 4, False, "contiguous"),
    ("causal-ragged-gqa", 2, 700, 700, 4, 2, True, "contiguous"),
    ("ragged-sk-shorter", 1, 333, 200, 2, 2, False, "contiguous"),
    ("sdpa-layout", 2, 640, 640, 4, 2, False, "sdpa"),
    ("fused-qkv-ragged-causal", 2, 333, 333, 4, 4, True, "fused-qkv"),
]


@pytest.mark.parametrize("case", DQ_CASES, ids=[c[0] for c in DQ_CASES])
def test_sm90_dq_kernel_matches_float64_reference(case, monkeypatch):
    """The Gluon dQ kernel of the two-kernel backward at d = 256 (``deterministic=True``): dQ
    within 3x PyTorch's bf16 error of float64, bitwise reproducible, and the same as the Triton
    dQ kernel's (``FLASHTILE_SM90_DQ=0``) within that error; inputs in the SDPA layout or
    sliced from a fused projection as well (dQ in q's layout)."""
    _, batch, sq, sk, heads, heads_k, causal, layout = case
    d = 256
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.delenv("FLASHTILE_SM90_DQ", raising=False)
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(batch, sq, heads, d, device="cuda", dtype=torch.bfloat16)
    names = _launch_names(monkeypatch)

    def arg(x):
        return x if layout == "contiguous" else _in_layout(x, layout)

    def dq():
        leaves = [arg(x).detach().requires_grad_() for x in (q, k, v)]
        with poison_outputs():
            flashtile.flash_attn_func(*leaves, causal=causal, deterministic=True).backward(
                arg(do))
        return leaves[0].grad

    got = dq()
    assert "dq" in names and "bwd" in names, names
    assert torch.equal(got, dq())
    ref = _grads(q, k, v, do, causal, torch.float64)[1]
    low = _grads(q, k, v, do, causal, torch.bfloat16)[1]
    base = (low.double() - ref).abs().max().item()
    err = (got.double() - ref).abs().max().item()
    assert torch.isfinite(got).all() and err <= 3 * base + 1e-4, (err, base)
    monkeypatch.setenv("FLASHTILE_SM90_DQ", "0")
    triton_dq = dq()
    assert (triton_dq.double() - got.double()).abs().max().item() <= 3 * base + 1e-4


PADDED_CASES = [  # (batch, sq, sk, heads, heads_k, d, causal, layout)
    ("d96-causal-gqa", 2, 512, 512, 4, 2, 96, True, "contiguous"),
    ("d96-ragged", 2, 300, 333, 4, 4, 96, False, "contiguous"),
    ("d96-one-head-ragged-causal", 2, 200, 457, 1, 1, 96, True, "contiguous"),
    ("d80-sdpa", 2, 384, 384, 4, 4, 80, False, "sdpa"),
    ("d112-sdpa-ragged-causal", 1, 300, 300, 4, 2, 112, True, "sdpa"),
    ("d96-fused-qkv-ragged", 2, 250, 250, 4, 4, 96, True, "fused-qkv"),
    ("d160", 2, 256, 320, 4, 4, 160, False, "contiguous"),
    ("d192-causal-ragged-gqa", 2, 300, 300, 6, 2, 192, True, "contiguous"),
    ("d192-sdpa-ragged", 1, 333, 200, 4, 4, 192, False, "sdpa"),
]


def _padded_case_inputs(batch, sq, sk, heads, heads_k, d, dtype):
    """q, k, v, dO of a case: ``(B, S, H, D)`` on the GPU, fresh random values."""
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    do = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    return q, k, v, do


@pytest.mark.parametrize("split", [False, True], ids=["padded", "split"])
@pytest.mark.parametrize("case", PADDED_CASES, ids=[c[0] for c in PADDED_CASES])
def test_sm90_forward_pads_head_dims_to_the_next_width(case, split, monkeypatch):
    """Head dims between 64 and 256 other than those (multiples of 8) run the Hopper forward
    at the next width (``launch_sm90.padded_width``): the descriptors' tiles reach past each
    head's last column, where the TMA reads zeros and stores nothing, heads side by side
    through a view with a dimension for the heads.  The forward's output and lse within
    flash-attn's rule of float64 (out 2x, gradients 3x through the portable backward), every
    layout a model hands in (contiguous, SDPA, slices of a fused QKV projection), lengths
    multiples of the tiles or not.  With ``FWD_SPLIT`` a head dim of two tile widths
    (``split_width``: 80, 96, 160, 192 here) takes the split kernel instead, no tile past the
    head's last column."""
    _, batch, sq, sk, heads, heads_k, d, causal, layout = case
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "_fwd_plans", type(launch_sm90._fwd_plans)())
    monkeypatch.setattr(launch_sm90, "FWD_SPLIT", split)
    # (the portable backward: the views' backward has its own test, views_match)
    monkeypatch.setattr(launch_sm90, "PAD_VIEW_KEYS", 1 << 30)
    dtype = torch.bfloat16
    q, k, v, do = _padded_case_inputs(batch, sq, sk, heads, heads_k, d, dtype)
    names = _launch_names(monkeypatch)
    leaves = [_in_layout(x, layout).detach().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        out = flashtile.flash_attn_func(*leaves, causal=causal)
        out.backward(do)
    # the Hopper forward, then the portable backward
    assert names and names[0] == _fwd_name(d), names
    assert "bwd" not in names and "dq" not in names, names
    ref = _grads(q, k, v, do, causal, torch.float64)
    low = _grads(q, k, v, do, causal, dtype)
    for name, g, r, lo, rule in zip(("out", "dq", "dk", "dv"), [out] + [x.grad for x in leaves],
                                    ref, low, (2, 3, 3, 3)):
        base = (lo.double() - r).abs().max().item()
        err = (g.double() - r).abs().max().item()
        assert torch.isfinite(g).all() and err <= rule * base + 1e-4, (name, err, base)
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5,
                                            window_right=0 if causal else -1)
    _, lse = launch_sm90.forward(*(x.detach() for x in leaves), spec)
    _, ref_lse = _reference(q, k, v, causal, torch.float64)
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3


@pytest.mark.parametrize("split", [False, True], ids=["padded", "split"])
@pytest.mark.parametrize("d", [96, 192])
def test_sm90_padded_head_dims_keep_heads_apart(d, split, monkeypatch):
    """With heads side by side in a row, a tile of the padded width starting at a head's first
    column would read the next head's: with head 1 all NaN, head 0's output is finite and
    within flash-attn's rule of float64, and its stores leave head 1's output alone (NaN from
    its own inputs, not head 0's values); the split kernel's second tiles likewise
    (``FWD_SPLIT``)."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "FWD_SPLIT", split)
    batch, sq, heads = 2, 300, 2
    q, k, v = (torch.randn(batch, sq, heads, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    for x in (q, k, v):
        x[:, :, 1] = float("nan")
    names = _launch_names(monkeypatch)
    with poison_outputs():
        out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert names == ["fwd_split" if split else "fwd"], names
    ref, _ = _reference(q[:, :, :1], k[:, :, :1], v[:, :, :1], True, torch.float64)
    low, _ = _reference(q[:, :, :1], k[:, :, :1], v[:, :, :1], True, torch.bfloat16)
    base = (low.double() - ref).abs().max().item()
    assert torch.isfinite(out[:, :, 0]).all()
    assert (out[:, :, :1].double() - ref).abs().max().item() <= 2 * base + 1e-4
    assert torch.isnan(out[:, :, 1]).all()


@pytest.mark.parametrize("d,causal", [(96, True), (96, False), (192, True)])
def test_sm90_padded_head_dims_backward_over_long_keys_on_hopper(d, causal, monkeypatch):
    """From ``launch_sm90.PAD_BWD_KEYS`` keys a padded head dim's backward that the views do
    not serve (``PAD_BWD_VIEWS`` off here) runs on the Hopper kernels over copies padded with
    zeros to the next width (``launch_bwd._padded_backward``): a Hopper backward kernel
    launches, and the gradients (cropped, in the inputs' layouts) are within flash-attn's rule
    of float64; at SDPA layout inputs too."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", False)
    batch, seq, heads = 1, launch_sm90.PAD_BWD_KEYS, 2
    q, k, v, do = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    names = _launch_names(monkeypatch)
    leaves = [_in_layout(x, "sdpa").detach().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        out = flashtile.flash_attn_func(*leaves, causal=causal)
        out.backward(do)
    assert names[0] == _fwd_name(d), names
    assert len(names) > 1 and set(names[1:]) <= {"bwd", "bwd_split", "dq", "dq_split"}, names
    _assert_grads_within_rule(leaves, q, k, v, do, causal)


def _assert_grads_within_rule(leaves, q, k, v, do, causal):
    """The leaves' gradients finite and within flash-attn's rule (3x PyTorch's same-dtype
    error) of float64 attention of ``q``, ``k``, ``v``; in the leaves' own layouts where these
    own their storage (a slice of a fused projection gets autograd's contiguous layout)."""
    ref = _grads(q, k, v, do, causal, torch.float64)
    low = _grads(q, k, v, do, causal, q.dtype)
    for name, x, r, lo in zip(("dq", "dk", "dv"), leaves, ref[1:], low[1:]):
        g = x.grad
        if x.untyped_storage().nbytes() == x.numel() * x.element_size():
            assert g.stride() == x.stride(), name
        base = (lo.double() - r).abs().max().item()
        err = (g.double() - r).abs().max().item()
        assert torch.isfinite(g).all() and err <= 3 * base + 1e-4, (name, err, base)


def _views_backward(monkeypatch):
    """The Hopper kernels on, the padded backward through views (``PAD_BWD_VIEWS``) at any
    number of keys."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", True)
    monkeypatch.setattr(launch_sm90, "PAD_VIEW_KEYS", 1)


@pytest.mark.parametrize("narrow", [False, True], ids=["wide-dkdv", "narrow-dkdv"])
@pytest.mark.parametrize("case", PADDED_CASES, ids=[c[0] for c in PADDED_CASES])
def test_sm90_padded_backward_views_match_float64_reference(case, narrow, monkeypatch):
    """``launch_sm90.padded_backward`` (``PAD_BWD_VIEWS``; ``PAD_VIEW_KEYS`` lowered so that
    short sequences take it): the Hopper backward kernels of the next width read q, dO, k and v
    through the forward's views (zeros past each head's last column, no copies) and write dK,
    dV and the dQ accumulator at that width (the dQ kernel at 256 through a view of dq),
    cropped: gradients within flash-attn's rule of float64 in every layout a model hands in,
    lengths multiples of the tiles or not, GQA, one head; with ``PAD_NARROW_DKDV`` dK and dV
    stored into the gradients themselves where the kernels can (``_narrow_dkdv``; their
    buffers poisoned: every column written)."""
    _, batch, sq, sk, heads, heads_k, d, causal, layout = case
    _views_backward(monkeypatch)
    monkeypatch.setattr(launch_sm90, "PAD_NARROW_DKDV", narrow)
    q, k, v, do = _padded_case_inputs(batch, sq, sk, heads, heads_k, d, torch.bfloat16)
    names = _launch_names(monkeypatch)
    widths = []  # the head dims the backward runs at (the copies' path: d, then the width)
    real = launch_bwd._backward
    monkeypatch.setattr(launch_bwd, "_backward", lambda do_, q_, *a, **kw: widths.append(
        q_.shape[-1]) or real(do_, q_, *a, **kw))
    leaves = [_in_layout(x, layout).detach().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        out = flashtile.flash_attn_func(*leaves, causal=causal)
        out.backward(do)
    want = [_fwd_name(d)] + ([_bwd_name(d)] if d <= 128 else [_dq_name(d), _bwd_name(d)])
    assert names == want and widths == [d], (names, widths)
    _assert_grads_within_rule(leaves, q, k, v, do, causal)


def _backward_in_layout(q, k, v, do, layout, causal):
    """Leaves of ``q``, ``k``, ``v`` in ``layout`` (``_in_layout``) after
    ``flash_attn_func(...).backward(do)`` with the outputs poisoned: their ``.grad``."""
    leaves = [_in_layout(x, layout).detach().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        out = flashtile.flash_attn_func(*leaves, causal=causal)
        out.backward(do)
    return leaves


# the padded head dims of 128 and a smaller tile (launch_sm90.split_width: 144, 160, 192), and
# two more layouts and lengths
SPLIT_DQ_CASES = [c for c in PADDED_CASES if launch_sm90.split_width(c[6]) == 128] + [
    ("d144-fused-qkv-causal", 2, 256, 256, 4, 4, 144, True, "fused-qkv"),
    ("d192-sdpa-causal-gqa-1k", 1, 1024, 1024, 4, 1, 192, True, "sdpa"),
]


@pytest.mark.parametrize("dkdv", ["dkdv-256", "dkdv-split"])
@pytest.mark.parametrize("case", SPLIT_DQ_CASES, ids=[c[0] for c in SPLIT_DQ_CASES])
def test_sm90_split_dq_kernel_matches_float64_reference(case, dkdv, monkeypatch):
    """With ``launch_sm90.DQ_SPLIT`` the dQ pass of a padded head dim that is 128 and a smaller
    tile's width runs the split dQ kernel (``attn_bwd_dq_split_sm90_kernel``: q, dO, k, v and
    dq through two descriptors each, no column past the head), then the dK/dV kernel of width
    256 through the views, or with ``BWD_SPLIT`` the split dK/dV kernel
    (``attn_bwd_split_sm90_kernel``): gradients within flash-attn's rule of float64 in the
    inputs' layouts (GQA, lengths multiples of the tiles or not, sk != sq, causal or not), the
    same bits in a second call (no atomics)."""
    _, batch, sq, sk, heads, heads_k, d, causal, layout = case
    _views_backward(monkeypatch)
    monkeypatch.setattr(launch_sm90, "DQ_SPLIT", True)
    monkeypatch.setattr(launch_sm90, "BWD_SPLIT", dkdv == "dkdv-split")
    q, k, v, do = _padded_case_inputs(batch, sq, sk, heads, heads_k, d, torch.bfloat16)
    names = _launch_names(monkeypatch)
    leaves = _backward_in_layout(q, k, v, do, layout, causal)
    bwd = "bwd_split" if launch_sm90.BWD_SPLIT else "bwd"
    assert names == [_fwd_name(d), "dq_split", bwd], names
    _assert_grads_within_rule(leaves, q, k, v, do, causal)
    again = _backward_in_layout(q, k, v, do, layout, causal)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(again, leaves))


def test_sm90_split_dq_kernels_of_two_head_dims_in_one_process(monkeypatch):
    """Split dQ and dK/dV kernels of two head dims whose launches differ in nothing but the
    head dim (144 and 192: the same width, flags and descriptor ranks), one after the other in
    one process: each gets compiled variants of its own (the launch keys hold the head dim),
    gradients within flash-attn's rule of float64 for both."""
    _views_backward(monkeypatch)
    monkeypatch.setattr(launch_sm90, "DQ_SPLIT", True)
    monkeypatch.setattr(launch_sm90, "BWD_SPLIT", True)
    for d in (144, 192, 144):
        q, k, v, do = _padded_case_inputs(2, 256, 256, 4, 4, d, torch.bfloat16)
        names = _launch_names(monkeypatch)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with poison_outputs():
            out = flashtile.flash_attn_func(*leaves, causal=True)
            out.backward(do)
        assert names == [_fwd_name(d), "dq_split", "bwd_split"], names
        _assert_grads_within_rule(leaves, q, k, v, do, True)


# the padded head dims of 64 and a smaller tile (launch_sm90.split_width: 80, 96), and more
# layouts and lengths
SPLIT_128_CASES = [c for c in PADDED_CASES if launch_sm90.split_width(c[6]) == 64] + [
    ("d80-causal-gqa-ragged", 2, 333, 333, 4, 2, 80, True, "contiguous"),
    ("d96-sdpa-causal-gqa-1k", 1, 1024, 1024, 4, 1, 96, True, "sdpa"),
    ("d96-sk-longer-fused-qkv", 2, 256, 640, 4, 4, 96, False, "fused-qkv"),
]


@pytest.mark.parametrize("case", SPLIT_128_CASES, ids=[c[0] for c in SPLIT_128_CASES])
def test_sm90_split_backward_of_width_128_matches_float64_reference(case, monkeypatch):
    """With ``launch_sm90.BWD128_SPLIT`` the fused backward of a padded head dim that is 64
    and a smaller tile's width (80, 96) runs the split kernel with the consumers of d = 128
    (``attn_bwd_split_sm90_kernel``: q, dO, k and v through two descriptors each, dK, dV and
    dq of each tile's columns, none past the head): the only Hopper backward launch, gradients
    within flash-attn's rule of float64 in the inputs' layouts (GQA, lengths multiples of the
    tiles or not, sk != sq, causal or not)."""
    _, batch, sq, sk, heads, heads_k, d, causal, layout = case
    _views_backward(monkeypatch)
    monkeypatch.setattr(launch_sm90, "BWD128_SPLIT", True)
    q, k, v, do = _padded_case_inputs(batch, sq, sk, heads, heads_k, d, torch.bfloat16)
    names = _launch_names(monkeypatch)
    leaves = _backward_in_layout(q, k, v, do, layout, causal)
    assert names == [_fwd_name(d), "bwd_split"], names
    _assert_grads_within_rule(leaves, q, k, v, do, causal)


@pytest.mark.parametrize("d,causal,seq,narrow", [(96, True, 384, False), (96, False, 300, False),
                                                 (96, False, 384, True),
                                                 (192, True, 384, False), (192, True, 384, True)],
                         ids=["d96-causal", "d96-ragged", "d96-narrow-dkdv", "d192-two-kernels",
                              "d192-two-kernels-narrow-dkdv"])
def test_sm90_padded_backward_repeats_through_plans_with_its_crops(d, causal, seq, narrow,
                                                                   monkeypatch):
    """A padded head dim's backward through views (``padded_backward``) called again with the
    same shapes: at d = 96 the fused kernel's direct launch leaves a plan of width 128 whose
    replay on new tensors crops dK and dV bitwise as the full path does (dQ within the
    accumulator's summation order); at d = 192 (the dQ and dK/dV kernels) no plan of either
    kind, since a launch plan would skip the crops (``fastlaunch.unplannable``): repeated calls
    bitwise the full path's; with ``PAD_NARROW_DKDV`` the dK/dV kernel stores into dk and dv
    itself (no crops), the call is launches only and replays as a launch plan, bitwise; at
    d = 96 the fused kernel's own stores (heads side by side) hold the crops' dK and dV
    bitwise.  With ``PAD_BWD_VIEWS`` off the plan serves no call."""
    from flashtile.backends import triton as backend
    from flashtile.backends.triton.fastlaunch import PlanCache

    _views_backward(monkeypatch)
    monkeypatch.setattr(launch_sm90, "PAD_NARROW_DKDV", narrow)
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "_bwd_plans", PlanCache())
    monkeypatch.setattr(launch_bwd, "_plans", PlanCache())
    spec = flashtile.backends.spec.AttnSpec(softmax_scale=d ** -0.5,
                                            window_right=0 if causal else -1)
    setting = launch_bwd._chunk_env()

    def inputs():
        return _backward_inputs(seq, d, spec)

    do, q, k, v, out, lse = inputs()
    backend.backward(do, q, k, v, out, lse, spec)  # compiled (or found), then launched directly
    backend.backward(do, q, k, v, out, lse, spec)
    assert bool(launch_bwd._plans._plans) == (narrow and d == 192)
    do, q, k, v, out, lse = inputs()
    with poison_outputs():  # (plans are off while outputs are poisoned)
        full = launch_bwd._backward(do, q, k, v, out, lse, spec)
    assert all(torch.isfinite(g).all() for g in full)
    if narrow:  # the narrow stores hold what the wide buffers' crops hold, bitwise
        monkeypatch.setattr(launch_sm90, "PAD_NARROW_DKDV", False)
        with poison_outputs():
            wide = launch_bwd._backward(do, q, k, v, out, lse, spec)
        # (dQ: the fused kernel's float32 sum in no fixed order, below)
        assert all(torch.equal(g, w) for g, w in list(zip(full, wide))[d == 96:])
        if d == 96:
            torch.testing.assert_close(full[0], wide[0], rtol=2 ** -7, atol=1e-3)
        monkeypatch.setattr(launch_sm90, "PAD_NARROW_DKDV", True)
    again = [backend.backward(do, q, k, v, out, lse, spec) for _ in range(2)]
    if d == 192:
        assert not launch_sm90._bwd_plans._plans
        for grads in again:
            assert all(torch.equal(g, f) for g, f in zip(grads, full))
        return
    (plan,) = launch_sm90._bwd_plans._plans.values()
    assert plan.width == 128 and plan.fast is not None and plan.prologue is not None
    planned = launch_sm90.planned_backward(q, k, v, out, do, lse, spec, setting)
    assert planned is not None
    for grads in (planned, *again):
        assert [g.shape for g in grads] == [x.shape for x in (q, k, v)]
        assert torch.equal(grads[1], full[1]) and torch.equal(grads[2], full[2])
        # a float32 sum in another order rounds to bf16 at most one unit (2^-7) apart
        torch.testing.assert_close(grads[0], full[0], rtol=2 ** -7, atol=1e-3)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", False)
    assert launch_sm90.planned_backward(q, k, v, out, do, lse, spec, setting) is None


@pytest.mark.parametrize("d", [96, 192])
def test_sm90_padded_backward_views_keep_heads_apart(d, monkeypatch):
    """The backward's views of heads side by side: with head 1 all NaN, head 0's gradients are
    finite and within flash-attn's rule of float64 (no tile of the kernels' width read into
    the next head's columns)."""
    _views_backward(monkeypatch)
    batch, seq, heads = 2, 300, 2
    q, k, v, do = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    for x in (q, k, v, do):
        x[:, :, 1] = float("nan")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        flashtile.flash_attn_func(*leaves, causal=True).backward(do)
    one = [x[:, :, :1] for x in (q, k, v, do)]
    ref = _grads(*one, True, torch.float64)
    low = _grads(*one, True, torch.bfloat16)
    for name, x, r, lo in zip(("dq", "dk", "dv"), leaves, ref[1:], low[1:]):
        g = x.grad[:, :, :1]
        base = (lo.double() - r).abs().max().item()
        assert torch.isfinite(g).all(), name
        assert (g.double() - r).abs().max().item() <= 3 * base + 1e-4, name
