"""Packed sequences (``flash_attn_varlen_func``) on the Hopper (Gluon) kernels: each sequence's
output, lse and gradients against the float64 oracle under flash-attn's error rule, sequences
with no key or no query, the launches they take, repeatability, and launch plans of packed
calls; skipped without an sm_90 GPU."""
import pytest
import torch
from helpers import assert_flash_rule, assert_grads_flash_rule, spy_keyword

from flashtile import flash_attn_varlen_func
from flashtile.autograd import attention
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton import launch_bwd, launch_sm90
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.reference.torch_ref import reference, scores

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")

# (id, query lengths, key lengths (None: the same), heads, heads_k, d, causal, window)
CASES = [
    ("d128-mixed", [1, 127, 128, 300, 1000], None, 4, 4, 128, False, (-1, -1)),
    ("d128-causal-gqa", [513, 64, 777, 2], None, 8, 2, 128, True, (-1, -1)),
    # (d = 64 without masking: the backward in 128-row query tiles, launch_sm90.bwd_rows)
    ("d64-mixed-gqa", [1, 127, 128, 300, 1000, 129], None, 4, 2, 64, False, (-1, -1)),
    ("d64-more-keys", [100, 250, 640], [300, 250, 900], 2, 2, 64, False, (-1, -1)),
    ("d64-causal-more-keys", [100, 250, 640], [300, 250, 900], 4, 4, 64, True, (-1, -1)),
    ("d64-short-causal", [33, 200, 64, 7, 150], None, 6, 3, 64, True, (-1, -1)),
    ("d64-window", [900, 400], None, 4, 4, 64, True, (96, 0)),
    ("d128-fewer-keys-causal", [300, 200], [100, 250], 4, 4, 128, True, (-1, -1)),
    ("d128-empty-sequences", [0, 129, 300, 0], [50, 0, 300, 10], 2, 2, 128, False, (-1, -1)),
    ("d256", [255, 64, 400], None, 2, 2, 256, False, (-1, -1)),
    ("d256-causal", [300, 513], None, 2, 1, 256, True, (-1, -1)),
    # head dims the forward runs at the next width (launch_sm90.padded_width): a sequence's
    # last row tile stored by the kernel at the head's own columns; the backward is portable
    ("d96-causal-gqa", [300, 1, 777, 64], None, 8, 2, 96, True, (-1, -1)),
    ("d80-one-head", [129, 500, 33], [200, 100, 400], 1, 1, 80, False, (-1, -1)),
    ("d192-window", [700, 129], None, 4, 4, 192, True, (96, 0)),
]


def _inputs(case, dtype):
    _, lq, lk, heads, heads_k, d, causal, window = case
    lk = lk or lq
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    q = torch.randn(sum(lq), heads, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lk), heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lk), heads_k, d, device="cuda", dtype=dtype)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_left=window[0],
                    window_right=0 if causal else window[1])
    return q, k, v, cu_q, cu_k, max(lq), max(lk), spec


def _per_sequence(q, k, v, cu_q, cu_k, spec, dtype):
    """The oracle's ``(out (total_q, H, D), lse (H, total_q))``, sequence by sequence
    (bottom-right windows within each; a row that sees no key: 0 and lse -inf)."""
    outs, lses = [], []
    for i in range(cu_q.numel() - 1):
        a, b = int(cu_q[i]), int(cu_q[i + 1])
        c, e = int(cu_k[i]), int(cu_k[i + 1])
        qs, ks, vs = q[None, a:b], k[None, c:e], v[None, c:e]
        outs.append(reference(qs, ks, vs, spec, dtype=dtype)[0])
        lses.append(torch.logsumexp(scores(qs, ks, spec, dtype=dtype), -1)[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


SPLIT_CASES = [c for c in CASES if launch_sm90.split_width(c[5])]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_sm90_varlen_split_forward_matches_float64_reference(case, monkeypatch):
    """Packed sequences at a head dim of two tile widths through the split kernel
    (``FWD_SPLIT``): output within 2x PyTorch's same-dtype error of float64 (each sequence's
    last row tile stored from registers in two parts), lse within 1e-3, bitwise the same
    twice."""
    dtype = torch.bfloat16
    q, k, v, cu_q, cu_k, max_q, max_k, spec = _inputs(case, dtype)
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "FWD_SPLIT", True)
    names = []
    real = launch_sm90._launch
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, *a: names.append(name) or real(
        name, *a))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    with poison_outputs():
        out, lse = attention(q, k, v, spec, **kw)
        again, _ = attention(q, k, v, spec, **kw)
    assert names and names[0] == "fwd_split", names
    ref, ref_lse = _per_sequence(q, k, v, cu_q, cu_k, spec, torch.float64)
    low, _ = _per_sequence(q, k, v, cu_q, cu_k, spec, dtype)
    assert_flash_rule("out", out, ref, low, 2)
    assert torch.equal(out, again)
    seen = torch.isfinite(ref_lse)
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_varlen_forward_matches_float64_reference(case, dtype, monkeypatch):
    """The Hopper forward of packed sequences: output within 2x PyTorch's same-dtype error of
    float64, lse within 1e-3, rows that see no key 0 with lse -inf, the same output twice
    bitwise (no store reaches another sequence's rows), the portable kernel within the same
    error."""
    q, k, v, cu_q, cu_k, max_q, max_k, spec = _inputs(case, dtype)
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    calls = spy_keyword(monkeypatch, launch_sm90, "forward", "varlen")
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    with poison_outputs():
        out, lse = attention(q, k, v, spec, **kw)
        again, _ = attention(q, k, v, spec, **kw)
    assert len(calls) == 2 and calls[0] is not None  # the Hopper kernel, packed
    ref, ref_lse = _per_sequence(q, k, v, cu_q, cu_k, spec, torch.float64)
    low, _ = _per_sequence(q, k, v, cu_q, cu_k, spec, dtype)
    assert_flash_rule("out", out, ref, low, 2)
    assert torch.equal(out, again)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= 1e-3
    assert (out.transpose(0, 1)[~seen] == 0).all()
    monkeypatch.setenv("FLASHTILE_SM90", "0")
    portable, _ = attention(q, k, v, spec, **kw)
    assert_flash_rule("portable out", portable, ref, low, 2)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_varlen_backward_matches_float64_reference(case, dtype, monkeypatch):
    """``flash_attn_varlen_func``'s gradients within 3x PyTorch's same-dtype error of float64:
    the fused Hopper backward at d = 64 and 128, and at the head dims the forward pads to 128
    that of width 128 through views of the head's columns (``launch_sm90.PAD_BWD_VIEWS``,
    ``padded_backward``; the portable kernels at d = 256 and 192), from the
    Hopper forward's output and lse; rows that see no key get no dQ, keys that no row sees
    no dK, dV (the buffers are poisoned with NaN)."""
    q, k, v, cu_q, cu_k, max_q, max_k, spec = _inputs(case, dtype)
    do = torch.randn_like(q)
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", True)
    calls = spy_keyword(monkeypatch, launch_sm90, "forward", "varlen")
    fused = spy_keyword(monkeypatch, launch_sm90, "fused_backward", "varlen")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=spec.causal,
                                     window_size=(spec.window_left, spec.window_right))
        out.backward(do)
    assert len(calls) == 1 and calls[0] is not None
    assert len(fused) == (1 if launch_sm90.padded_width(q.shape[-1]) in (64, 128) else 0)
    assert all(f is not None for f in fused)
    assert_grads_flash_rule([x.grad for x in leaves], (q, k, v), do, lambda q_, k_, v_, dt:
                            _per_sequence(q_, k_, v_, cu_q, cu_k, spec, dt)[0], dtype)


@pytest.mark.parametrize("d,narrow", [(128, False), (96, False), (96, True)],
                         ids=["d128", "d96-views", "d96-views-narrow-dkdv"])
def test_sm90_varlen_plans_repeat_the_launches_with_the_new_lengths(d, narrow, monkeypatch):
    """A packed call launched directly (a compiled variant's second call) leaves forward and
    backward plans; a later call of the same totals, sequence count and longest lengths but
    other sequences runs through them (no full launch path): its output bitwise the full
    path's for its own lengths, its gradients within 3x PyTorch's same-dtype error of float64
    per its own sequences.  At d = 96 the backward's plan is of the kernel of width 128
    through views of the head's columns (``padded_backward``), whose gradients the plan crops
    too; with ``PAD_BWD_VIEWS`` off it serves no call.  With ``PAD_NARROW_DKDV`` the kernel
    stores dK and dV into the narrow gradients itself (columns masked), the plan too."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", True)
    monkeypatch.setattr(launch_sm90, "PAD_NARROW_DKDV", narrow)
    monkeypatch.setattr(launch_sm90, "_fwd_plans", type(launch_sm90._fwd_plans)())
    monkeypatch.setattr(launch_sm90, "_bwd_plans", type(launch_sm90._bwd_plans)())
    dtype = torch.bfloat16
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0)   # causal, GQA
    runs = []
    for lengths in ([300, 129, 700], [300, 129, 700], [700, 1, 428]):
        q, k, v, cu_q, cu_k, max_q, max_k, _ = _inputs(
            ("plan", lengths, None, 8, 2, d, True, (-1, -1)), dtype)
        do = torch.randn_like(q)
        full_fwd = spy_keyword(monkeypatch, launch_sm90, "forward", "varlen")
        full_bwd = spy_keyword(monkeypatch, launch_sm90, "fused_backward", "varlen")
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=True)
        out.backward(do)
        runs.append((len(full_fwd), len(full_bwd)))   # (each round's spies wrap the last's)
    assert runs[0] == (1, 1) and runs[-1] == (0, 0)   # the last call: both plans
    (plan,) = launch_sm90._bwd_plans._plans.values()   # its prologue bound (BoundLaunch)
    assert plan.prologue is not None and plan.width == (0 if d == 128 else 128)
    assert plan.wide_dkdv == (d != 128 and not narrow)
    assert torch.equal(out, launch_sm90.forward(q, k, v, spec, varlen=(cu_q, cu_k, 700, 700))[0])
    assert_grads_flash_rule([x.grad for x in leaves], (q, k, v), do, lambda q_, k_, v_, dt:
                            _per_sequence(q_, k_, v_, cu_q, cu_k, spec, dt)[0], dtype)
    if d != 128:
        monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", False)
        assert launch_sm90.planned_backward(
            q, k, v, out, do, launch_sm90.forward(q, k, v, spec, varlen=(cu_q, cu_k, 700, 700))[1],
            spec, launch_bwd._chunk_env(), varlen=launch_sm90.packed_args(cu_q, cu_k, 700, 700)
        ) is None


def _packed_step(leaves, cu_q, cu_k, max_q, max_k, do, causal):
    """One packed forward + backward into the leaves' ``.grad``: the output."""
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=causal)
    out.backward(do)
    return out


@pytest.mark.parametrize("d,causal", [(64, True), (128, False)], ids=["d64-causal", "d128"])
def test_sm90_varlen_cuda_graph_replay_takes_new_lengths(d, causal):
    """A packed forward + backward captured in a CUDA graph (the capture path: no host read of
    the lengths, clamped indices, the order table built on the device) replays on new inputs
    and new sequence lengths of the same totals and longest lengths: output and dK, dV bitwise
    an eager call's on the new lengths, the gradients within 3x PyTorch's same-dtype error of
    float64 for the new sequences."""
    dtype = torch.bfloat16
    q, k, v, cu_q, cu_k, max_q, max_k, spec = _inputs(
        ("graph", [300, 129, 700], None, 4, 2, d, causal, (-1, -1)), dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    do = torch.randn_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm outside the capture
        for _ in range(2):
            _packed_step(leaves, cu_q, cu_k, max_q, max_k, do, causal)
    torch.cuda.current_stream().wait_stream(stream)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _packed_step(leaves, cu_q, cu_k, max_q, max_k, do, causal)
    new = _inputs(("graph", [700, 1, 428], None, 4, 2, d, causal, (-1, -1)), dtype)
    new_q, new_k, new_v, new_cu_q, new_cu_k = new[:5]
    new_do = torch.randn_like(do)
    with torch.no_grad():
        for x, y in zip(leaves, (new_q, new_k, new_v)):
            x.copy_(y)
    do.copy_(new_do)
    cu_q.copy_(new_cu_q)
    cu_k.copy_(new_cu_k)
    out.fill_(float("nan"))
    for x in leaves:
        x.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager_leaves = [x.detach().clone().requires_grad_() for x in (new_q, new_k, new_v)]
    eager = _packed_step(eager_leaves, new_cu_q, new_cu_k, max_q, max_k, new_do, causal)
    assert torch.equal(out, eager)
    assert torch.equal(leaves[1].grad, eager_leaves[1].grad)
    assert torch.equal(leaves[2].grad, eager_leaves[2].grad)
    assert_grads_flash_rule([x.grad for x in leaves], (new_q, new_k, new_v), new_do,
                            lambda q_, k_, v_, dt: _per_sequence(
                                q_, k_, v_, new_cu_q, new_cu_k, spec, dt)[0], dtype)


def test_sm90_varlen_compiled_fullgraph_dynamic_equals_eager(monkeypatch):
    """A packed forward compiled with ``fullgraph=True, dynamic=True`` (the custom ops) and the
    backward AOTAutograd builds for it launch the Hopper kernels, packed: output and dK, dV
    bitwise an eager call's, gradients within 3x PyTorch's same-dtype error of float64, for
    calls of different totals and sequence counts."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    monkeypatch.setattr(launch_sm90, "_fwd_plans", type(launch_sm90._fwd_plans)())
    monkeypatch.setattr(launch_sm90, "_bwd_plans", type(launch_sm90._bwd_plans)())
    dtype = torch.bfloat16
    fn = torch.compile(lambda q, k, v, cu_q, cu_k, max_q, max_k: flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=True), fullgraph=True, dynamic=True)
    for lengths in ([300, 129, 700], [513, 64, 777, 2]):
        q, k, v, cu_q, cu_k, max_q, max_k, spec = _inputs(
            ("compiled", lengths, None, 8, 2, 128, True, (-1, -1)), dtype)
        do = torch.randn_like(q)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        calls = spy_keyword(monkeypatch, launch_sm90, "forward", "varlen")
        fused = spy_keyword(monkeypatch, launch_sm90, "fused_backward", "varlen")
        out = fn(*leaves, cu_q, cu_k, max_q, max_k)
        got = torch.autograd.grad(out, leaves, do)
        assert len(calls) == 1 and calls[0] is not None   # new totals: no plan yet
        assert len(fused) == 1 and fused[0] is not None
        want_out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=True)
        want = torch.autograd.grad(want_out, leaves, do)
        assert torch.equal(out, want_out)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert_grads_flash_rule(got, (q, k, v), do, lambda q_, k_, v_, dt: _per_sequence(
            q_, k_, v_, cu_q, cu_k, spec, dt)[0], dtype)


# (id, query lengths, key lengths (None: the keys share the query's ragged dimension), heads,
# key/value heads, E, value head dim, causal)
JAGGED = [
    ("self-causal-gqa-d128", [300, 1, 777, 64], None, 8, 2, 128, 128, True),
    ("self-d64-value-dim-32", [129, 500], None, 4, 4, 64, 32, False),
    ("cross-causal-top-left-d128", [300, 40], [100, 400], 4, 4, 128, 128, True),
]


@pytest.mark.parametrize("case", JAGGED, ids=[c[0] for c in JAGGED])
def test_sm90_jagged_sdpa_matches_float64_per_sequence(case, monkeypatch):
    """``F.scaled_dot_product_attention``'s drop-in on jagged nested tensors ``(B, H, j, E)``
    on the GPU: each sequence's output and the packed inputs' gradients within flash-attn's
    rule of float64; where key and query share the ragged dimension the Hopper varlen kernels
    run (forward and fused backward), causal top-left per sequence otherwise."""
    from flashtile.interface import scaled_dot_product_attention as ft_sdpa
    name, lq, lk, heads, heads_kv, e, ev, causal = case
    dtype = torch.bfloat16
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], device="cuda")
    cu_k = cu_q if lk is None else torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()],
                                                device="cuda")
    lk = lk or lq
    inputs = [torch.randn(sum(lq), heads, e, device="cuda", dtype=dtype),
              torch.randn(sum(lk), heads_kv, e, device="cuda", dtype=dtype),
              torch.randn(sum(lk), heads_kv, ev, device="cuda", dtype=dtype)]
    leaves = [x.clone().requires_grad_() for x in inputs]

    def jagged(x, cu):  # (total, H, D) values -> (B, H, j, D)
        return torch.nested.nested_tensor_from_jagged(x, offsets=cu).transpose(1, 2)
    q, k, v = jagged(leaves[0], cu_q), jagged(leaves[1], cu_k), jagged(leaves[2], cu_k)
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    calls = spy_keyword(monkeypatch, launch_sm90, "forward", "varlen")
    fused = spy_keyword(monkeypatch, launch_sm90, "fused_backward", "varlen")
    with poison_outputs():
        out = ft_sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        values = out.transpose(1, 2).values()
        do = torch.randn_like(values)
        grads = torch.autograd.grad(values, leaves, do)
    assert out.is_nested and values.shape == (sum(lq), heads, ev)
    if k.shape[2] is q.shape[2]:
        assert calls and calls[0] is not None and fused and fused[0] is not None
    spec = AttnSpec(softmax_scale=e ** -0.5, window_right=0 if causal else -1,
                    bottom_right=False)

    def ref(q_, k_, v_, dt):  # each sequence's attention (top-left causal), packed again
        return torch.cat([reference(q_[None, a:b], k_[None, c:d], v_[None, c:d], spec,
                                    dtype=dt)[0]
                          for a, b, c, d in zip(cu_q.tolist(), cu_q[1:].tolist(),
                                                cu_k.tolist(), cu_k[1:].tolist())])
    assert_flash_rule("out", values, ref(*inputs, torch.float64), ref(*inputs, dtype), 2)
    assert_grads_flash_rule(list(grads), inputs, do, ref, dtype)


def test_sm90_jagged_sdpa_compiled_fullgraph_dynamic_equals_eager(monkeypatch):
    """The jagged drop-in under ``torch.compile(fullgraph=True, dynamic=True)`` on the GPU,
    on nested tensors that carry no longest length (the packed total bounds it while
    tracing): the Hopper varlen kernels run, and the output and the packed inputs' gradients
    equal the eager call's (bitwise; the query's gradient, summed by atomic adds in either
    order, within one bf16 rounding step), for two batches of different lengths and counts."""
    from flashtile.interface import scaled_dot_product_attention as ft_sdpa
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)

    def f(x, kv):
        q, k = x.transpose(1, 2), kv.transpose(1, 2)
        return ft_sdpa(q, k, k, is_causal=True, enable_gqa=True).transpose(1, 2)
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for lens in ([300, 1, 777, 64], [129, 500, 1000]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
        # 12 and 4 heads: no dimension equals the batch + 1 (PyTorch's guard bug, features.md)
        leaves = [torch.randn(sum(lens), h, 128, device="cuda", dtype=torch.bfloat16)
                  .requires_grad_() for h in (12, 4)]
        do = torch.randn(sum(lens), 12, 128, device="cuda", dtype=torch.bfloat16)
        calls = spy_keyword(monkeypatch, launch_sm90, "forward", "varlen")
        outs = []
        for fn in (compiled, f):
            x, kv = (torch.nested.nested_tensor_from_jagged(t, offsets=cu) for t in leaves)
            values = fn(x, kv).values()
            outs.append((values, *torch.autograd.grad(values, leaves, do)))
        assert calls and all(c is not None for c in calls)
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][2], outs[1][2])
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=2 ** -7, atol=0)
