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
    ("key-headdim", lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 16)), {}, ValueError, "head dim"),
    ("value-headdim-too-big", lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 264)), {}, ValueError, "headdim of value"),
    ("rank1", lambda: (torch.randn(16),) * 3, {}, ValueError, "query"),
    ("batch-dims", lambda: (torch.randn(2, 2, 8, 16), torch.randn(3, 2, 8, 16), torch.randn(3, 2, 8, 16)), {}, ValueError, "batch"),
    ("int-query", lambda: (torch.ones(1, 2, 8, 16, dtype=torch.int64), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)), {}, TypeError, "query"),
    # float64 runs PyTorch's own function, only with all three float64
    ("float64-query-float32-key", lambda: (torch.randn(1, 2, 8, 16, dtype=torch.float64), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)), {}, TypeError, "query, key and value must share one dtype, got float64, float32, float32"),
]


@pytest.mark.parametrize("make,kwargs,exc,needle", [b[1:] for b in SDPA_BAD], ids=[b[0] for b in SDPA_BAD])
def test_sdpa_rejects(make, kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        flashtile.scaled_dot_product_attention(*make(), **kwargs)


# ------------------------------------------------------------------------------------------
# one error class; checks that hold eager and under torch.compile; both backends
# ------------------------------------------------------------------------------------------
BOTH_BACKENDS = ["torch", "triton"]  # triton: the kernels under TRITON_INTERPRET=1 (conftest)


def test_input_error_is_value_and_runtime_error():
    """Code written for flash-attn (``RuntimeError``) and for flashtile (``ValueError``)
    catches the same error."""
    assert issubclass(flashtile.FlashtileInputError, ValueError)
    assert issubclass(flashtile.FlashtileInputError, RuntimeError)
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="window_size"):
        flashtile.flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(flashtile.FlashtileInputError, match="nheads"):
        flashtile.flash_attn_func(*qkv(h=4, hk=3))


def _i32(*v):
    return torch.tensor(v, dtype=torch.int32)


def _varlen_call(q, k, v, cq, ck, mq, mk, block_table=None):
    return flashtile.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=True,
                                            block_table=block_table)


def _compiled_varlen():
    # a fresh compile (no recompile limit falling back to eager); aot_eager: dynamo + AOT
    # tracing with the ops' fake implementations, no code generation
    torch._dynamo.reset()
    return torch.compile(_varlen_call, fullgraph=True, dynamic=False, backend="aot_eager")


def _varlen_case(name):
    """(args, exception, message) of one bad varlen input (new-user-trial section 5, compiled
    bypass); q/k/v hold 12 packed tokens of 2 heads."""
    q = torch.randn(12, 2, 16)
    k, v = torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    pool = torch.randn(4, 16, 2, 16), torch.randn(4, 16, 2, 16)
    good = _i32(0, 5, 12)
    cases = {
        "cu-k-not-monotone": ((q, k, v, good, _i32(0, 9, 5), 7, 9), ValueError, "non-decreasing"),
        "cu-past-total": ((q, k, v, _i32(0, 5, 20), _i32(0, 5, 20), 15, 15), ValueError,
                          "number of packed tokens"),
        "max-seqlen-too-small": ((q, k, v, good, good, 3, 7), ValueError, "max_seqlen_q"),
        "cu-int64": ((q, k, v, good.long(), good, 7, 7), TypeError, "cu_seqlens_q must be int32"),
        "page-past-pool": ((q, *pool, good, _i32(0, 20, 30), 7, 20, _i32(0, 99, 1, 2).reshape(2, 2)),
                           ValueError, r"block_table\[0, 1\] = 99"),
        "page-negative": ((q, *pool, good, _i32(0, 20, 30), 7, 20, _i32(0, 1, -3, 2).reshape(2, 2)),
                          ValueError, r"block_table\[1, 0\] = -3"),
    }
    return cases[name]


VARLEN_VALUE_CASES = ["cu-k-not-monotone", "cu-past-total", "max-seqlen-too-small", "cu-int64",
                      "page-past-pool", "page-negative"]


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", VARLEN_VALUE_CASES)
def test_varlen_value_checks_hold_eager_and_compiled(case, mode, backend):
    """The value checks of ``cu_seqlens`` / ``max_seqlen`` / ``block_table`` run inside the op:
    a compiled call rejects what an eager call rejects, before any backend runs."""
    args, exc, needle = _varlen_case(case)
    fn = _varlen_call if mode == "eager" else _compiled_varlen()
    if mode == "compiled" and exc is TypeError:
        # a type error found while tracing: fullgraph=True reports it as dynamo's Unsupported
        # error carrying the message
        exc = (TypeError, torch._dynamo.exc.Unsupported)
    with flashtile.use_backend(backend), pytest.raises(exc, match=needle):
        fn(*args)
    if mode == "compiled":
        torch._dynamo.reset()


def test_window_size_as_list_or_tensor(monkeypatch):
    """flash-attn's tests draw ``window_size`` with ``torch.randint``: a list or a 2-element
    integer tensor is the same window as the tuple."""
    monkeypatch.undo()  # this test runs the kernels
    q, k, v = (x.float() for x in qkv())
    want = flashtile.flash_attn_func(q, k, v, window_size=(3, 1))
    for w in ([3, 1], torch.tensor([3, 1]), torch.tensor([3, 1], dtype=torch.int32)):
        assert torch.equal(flashtile.flash_attn_func(q, k, v, window_size=w), want), w
    kc, vc = k.clone(), v.clone()
    want_kv = flashtile.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=6, window_size=(3, 1))
    for w in ([3, 1], torch.tensor([3, 1])):
        got = flashtile.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=6, window_size=w)
        assert torch.equal(got, want_kv), w
    with pytest.raises(TypeError, match="window_size"):
        flashtile.flash_attn_func(q, k, v, window_size=torch.tensor([3.0, 1.0]))
    with pytest.raises(ValueError, match="window_size"):
        flashtile.flash_attn_func(q, k, v, window_size=torch.tensor([3, 1, 2]))


# ------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: the dense rules, and index values checked on the host (torch
# backend) and on the device (the Triton path)
# ------------------------------------------------------------------------------------------
def _kv_setup(paged=True):
    q = torch.randn(2, 1, 4, 16)
    if paged:
        kc, bt = torch.randn(6, 16, 2, 16), _i32(0, 1, 2, 3, 4, 5).reshape(2, 3)
    else:
        kc, bt = torch.randn(2, 48, 2, 16), None
    kw = dict(k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16), cache_seqlens=_i32(10, 30),
              block_table=bt)
    return q, kc, torch.randn(kc.shape), kw


def test_kvcache_window_rules_match_dense():
    """``window_size=(-5, -7)`` is rejected as in ``flash_attn_func``; the same TypeError /
    ValueError choices for window, softcap and softmax_scale."""
    q, kc, vc, kw = _kv_setup()
    for bad, exc in (((-5, -7), ValueError), ("x", TypeError), (5, TypeError),
                     ((1, 2, 3), ValueError)):
        with pytest.raises(exc, match="window_size"):
            flashtile.flash_attn_with_kvcache(q, kc, vc, window_size=bad, **kw)
        with pytest.raises(exc, match="window_size"):
            flashtile.flash_attn_func(q, kc[:2], vc[:2], window_size=bad)
    with pytest.raises(TypeError, match="softcap"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, softcap="1", **kw)
    with pytest.raises(TypeError, match="softmax_scale"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, softmax_scale="1", **kw)
    with pytest.raises(ValueError, match="softmax_scale"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, softmax_scale=float("inf"), **kw)


KV_VALUE_CASES = {
    # name: (paged, mutate kwargs, message)
    "seqlens-negative": (True, dict(cache_seqlens=_i32(-1, 3)), r"cache_seqlens\[0\]=-1"),
    "seqlens-past-block-table": (True, dict(cache_seqlens=_i32(10, 48)), "block_table"),
    "leftpad-past-seqlens": (False, dict(cache_leftpad=_i32(0, 40)), r"cache_leftpad\[1\]=40"),
    "batch-idx-past-cache": (False, dict(cache_batch_idx=_i32(0, 5)), r"cache_batch_idx\[1\]=5"),
    "page-past-pool": (True, dict(block_table=_i32(0, 1, 2, 3, 99, 5).reshape(2, 3)),
                       r"block_table\[1, 1\]=99"),
    "page-negative": (True, dict(block_table=_i32(-2, 1, 2, 3, 4, 5).reshape(2, 3)),
                      r"block_table\[0, 0\]=-2"),
    "rotary-table-short": (True, dict(rotary_cos=torch.ones(20, 4), rotary_sin=torch.ones(20, 4)),
                           "rotary_cos"),
}


@pytest.mark.parametrize("backend,mode", [("torch", "host"), ("triton", "sync"), ("triton", "async")])
@pytest.mark.parametrize("case", list(KV_VALUE_CASES))
def test_kvcache_index_values_rejected_before_writing(case, backend, mode, monkeypatch):
    """Each bad index value raises ``FlashtileInputError`` naming the argument, and the cache
    is unchanged.  The torch backend checks on the host; the Triton path on the device:
    ``sync`` raises in the call, ``async`` (the default) returns NaN and raises at the next
    check."""
    paged, change, needle = KV_VALUE_CASES[case]
    monkeypatch.undo()  # the kernels run
    if mode != "host":
        monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", mode)
    q, kc, vc, kw = _kv_setup(paged)
    kw.update(change)
    k_before, v_before = kc.clone(), vc.clone()
    with flashtile.use_backend(backend), pytest.raises(flashtile.FlashtileInputError, match=needle):
        if mode == "async":
            assert flashtile.flash_attn_with_kvcache(q, kc, vc, **kw).isnan().all()
            flashtile.check_kvcache_errors()
        else:
            flashtile.flash_attn_with_kvcache(q, kc, vc, **kw)
    assert torch.equal(kc, k_before) and torch.equal(vc, v_before)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("append", [False, True])
def test_kvcache_paged_block_table_bounds(append, mode, monkeypatch):
    """flash-attn's ``test_flash_attn_kvcache_paged_block_table_bounds`` scenario: a length past
    what ``block_table`` addresses raises ``RuntimeError`` matching "block_table" (in the call
    with ``FLASHTILE_KVCACHE_CHECK=sync``, as flash-attn does; at the next call by default);
    exactly at capacity works."""
    monkeypatch.undo()
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", mode)
    page, d = 16, 16
    kc, vc = torch.randn(4, page, 1, d, dtype=torch.float16), torch.randn(4, page, 1, d, dtype=torch.float16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    q = torch.randn(1, 1, 1, d, dtype=torch.float16)
    kw = dict(k=torch.randn(1, 1, 1, d, dtype=torch.float16), v=torch.randn(1, 1, 1, d, dtype=torch.float16),
              cache_seqlens=_i32(page)) if append else dict(cache_seqlens=_i32(page + 1))
    with flashtile.use_backend("triton"):
        with pytest.raises(RuntimeError, match="block_table"):
            flashtile.flash_attn_with_kvcache(q, kc, vc, block_table=table, **kw)
            flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_i32(page), block_table=table)
        out = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_i32(page), block_table=table)
    assert out.shape == (1, 1, 1, d) and not out.isnan().any()
    flashtile.check_kvcache_errors()


def test_kvcache_guards_without_checks(monkeypatch):
    """With no check at all (``FLASHTILE_CHECK_INDICES=0``, the older spelling of
    ``FLASHTILE_KVCACHE_CHECK=off``), the Triton kernels still turn no bad index into an
    address: row 1's append past what its block table addresses and through page -7 is
    dropped, row 0's valid append lands in its page, and the call completes."""
    monkeypatch.undo()
    monkeypatch.delenv("FLASHTILE_KVCACHE_CHECK", raising=False)
    monkeypatch.setenv("FLASHTILE_CHECK_INDICES", "0")
    q, kc, vc, kw = _kv_setup(paged=True)
    for lens, table in ((_i32(10, 48), _i32(0, 1, 2, 3, 4, 5)), (_i32(10, 20), _i32(0, 1, 2, 3, -7, 5))):
        k_cache, v_cache = kc.clone(), vc.clone()
        kw.update(cache_seqlens=lens, block_table=table.reshape(2, 3))
        with flashtile.use_backend("triton"):
            out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
        want_k, want_v = kc.clone(), vc.clone()
        want_k[0, 10], want_v[0, 10] = kw["k"][0, 0], kw["v"][0, 0]  # row 0: page 0, slot 10
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
        assert out.shape == q.shape


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_varlen_guard_when_values_cannot_be_read(backend, monkeypatch):
    """Where no host read is possible (CUDA-graph capture, emulated here by switching the
    read-back off), varlen calls run on clamped index tensors: the identity for valid ones
    (bitwise the checked result, forward and backward) and in bounds for each bad input of
    the table (no crash), with every output and gradient row defined: fresh buffers are
    NaN-poisoned, so a row no kernel wrote (a token the clamped sequences leave out) fails the
    finiteness check."""
    monkeypatch.undo()
    from flashtile import _validate
    from flashtile.backends.triton.fastlaunch import poison_outputs
    cases = [_varlen_case(c)[0] for c in VARLEN_VALUE_CASES if c != "cu-int64"]
    valid = (*_varlen_case("cu-k-not-monotone")[0][:3], _i32(0, 5, 12), _i32(0, 4, 12), 7, 8)
    paged_ok = (*_varlen_case("page-past-pool")[0][:7], _i32(3, 0, 2, 1).reshape(2, 2))

    def run(args):
        leaves = [a.clone().requires_grad_() if i < 3 else a for i, a in enumerate(args)]
        out = _varlen_call(*leaves)
        return (out, *torch.autograd.grad(out.sum(), leaves[:3]))

    with flashtile.use_backend(backend):
        want = [run(valid), run(paged_ok)]
        monkeypatch.setattr(_validate, "value_checks_enabled", lambda device: False)
        for args, w in zip((valid, paged_ok), want):
            for got, expect in zip(run(args), w):
                assert torch.equal(got, expect)
        for args in cases:
            with poison_outputs():
                out, *grads = run(args)
            assert out.shape == args[0].shape and torch.isfinite(out).all()
            assert all(torch.isfinite(g).all() for g in grads)


def test_varlen_value_checks_read_a_lengths_tensor_once_while_unchanged(monkeypatch):
    """A model's layers pass the same ``cu_seqlens``: the value checks read them on the host
    once, again after an in-place change (and reject the new values), again for other totals
    or longest lengths, and on every call for inference tensors (no version counter)."""
    from flashtile import _validate as V

    monkeypatch.setattr(V, "_varlen_checked", type(V._varlen_checked)())
    reads = []
    real = V._cu_values
    monkeypatch.setattr(V, "_cu_values", lambda name, *a: reads.append(name) or real(name, *a))
    cu, k = _i32(0, 3, 7), torch.randn(7, 2, 16)
    for _ in range(3):
        V.varlen_values(cu, cu, 7, k, 4, 4, None)
    assert reads == ["cu_seqlens_q", "cu_seqlens_k"]
    cu[1] = 9
    with pytest.raises(ValueError, match="non-decreasing"):
        V.varlen_values(cu, cu, 7, k, 4, 4, None)
    cu[1] = 3
    V.varlen_values(cu, cu, 7, k, 4, 4, None)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        V.varlen_values(cu, cu, 7, k, 3, 4, None)
    assert len(reads) == 6   # (a rejected q stops before k)
    with torch.inference_mode():
        frozen = _i32(0, 3, 7)
        for _ in range(2):
            V.varlen_values(frozen, frozen, 7, k, 4, 4, None)
    assert len(reads) == 10


def test_tensor_cache_keys_on_the_tensor_objects_and_their_versions():
    """``TensorCache`` reuses a value for the same, unchanged tensors only: not for an equal
    tensor, not after an in-place write through a view, not for inference tensors."""
    from flashtile._tensor_cache import TensorCache

    cache, made = TensorCache(size=2), []

    def get(key, *tensors):
        return cache.get(key, tensors, lambda: made.append(key) or len(made))

    a = torch.zeros(4)
    assert get("x", a) == get("x", a) == 1
    assert get("x", a.clone()) == 2 and get("y", a) == 3
    a[1:].add_(1)
    assert get("x", a) == 4
    with torch.inference_mode():
        frozen = torch.zeros(4)
        assert get("x", frozen) == 5 and get("x", frozen) == 6


def test_spec_cache_keys_on_values_and_their_types():
    """``spec_of`` hands back the spec an earlier call with the same values of the same types
    made, so a repeated call builds none; a value equal to a valid one but of a rejected type
    (``softcap=False`` after ``softcap=0``, ``softmax_scale=True`` after ``1``) still raises,
    and a window given as a list or a tensor is read anew on every call."""
    from flashtile import _validate as V

    q = torch.empty(1, 4, 2, 16)
    first = V.spec(q, 1, True, (-1, -1), 0, 0.0)
    assert V.spec(q, 1, True, (-1, -1), 0, 0.0) is first
    assert first.softmax_scale == 1.0 and first.window_right == 0
    with pytest.raises(TypeError, match="softcap"):
        V.spec(q, 1, True, (-1, -1), False, 0.0)
    with pytest.raises(TypeError, match="softmax_scale"):
        V.spec(q, True, True, (-1, -1), 0, 0.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        V.spec(q, float("nan"), False, (-1, -1), 0, 0.0)
    w = [3, 1]
    assert V.spec(q, None, False, w, 0.0, 0.0).window_left == 3
    w[0] = 5
    assert V.spec(q, None, False, w, 0.0, 0.0).window_left == 5
    t = torch.tensor([2, 0])
    assert V.spec(q, None, False, t, 0.0, 0.0).window_left == 2
    t[0] = 7
    assert V.spec(q, None, False, t, 0.0, 0.0).window_left == 7
    # the other head dim's default scale, and the autograd layer's own specs
    assert V.spec(torch.empty(1, 4, 2, 64), None, False, (-1, -1), 0.0, 0.0).softmax_scale \
        == 64 ** -0.5
    from flashtile.autograd import _spec
    assert _spec(0.5, -1, 0, True, 0.0, 0.0) is _spec(0.5, -1, 0, True, 0.0, 0.0)
    assert _spec(0.5, -1, 0, True, 0.0, 0.0, True).deterministic
