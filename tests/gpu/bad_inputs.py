"""Every public function with each bad input: a clear error naming the argument, and no kernel
reading or writing out of bounds (run it under ``compute-sanitizer --tool memcheck``).

    python tests/gpu/bad_inputs.py                      # CUDA (the default when available)
    python tests/gpu/bad_inputs.py --device cpu         # the same table on the CPU
    python tests/gpu/bad_inputs.py --kvcache-check sync # kvcache index errors raised in the call
    # memcheck sees a tensor's own bounds only without the caching allocator (which CUDA
    # graphs need), so: eager and compiled cases uncached, then the graph cases
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python tests/gpu/bad_inputs.py --no-graphs
    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu/bad_inputs.py --graphs-only

Covers the dense, varlen, paged varlen, kvcache (with append and without), block-sparse and
SDPA functions, and compiled calls (``torch.compile(fullgraph=True)``) of varlen and kvcache.
The index values of a kvcache call on the GPU are checked on the device without a host wait
(``FLASHTILE_KVCACHE_CHECK=async``, the default): such a case passes when the call returns
without raising, wrote nothing into the caches, returned NaN, and
``flashtile.check_kvcache_errors()`` raises the error (with ``--kvcache-check sync``: when the
call itself raises).  Then the cases where only the kernels' guards stand between bad indices
and memory: CUDA graphs captured with valid indices and replayed with bad ones (kvcache: the
replay writes nothing, its output is NaN and ``check_kvcache_errors()`` reports it; varlen:
clamped index tensors, finite output), eager kvcache calls that replay a launch plan (no host
checks), and kvcache calls with ``FLASHTILE_KVCACHE_CHECK=off``.
Prints one line per case and exits 0 when every case behaved; 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import flashtile  # noqa: E402
from flashtile import (block_sparse_attn_func, flash_attn_func, flash_attn_kvpacked_func,  # noqa: E402
                       flash_attn_qkvpacked_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                       merge_attention_states, scaled_dot_product_attention)

InputError = flashtile.FlashtileInputError


def i32(dev, *v):
    return torch.tensor(v, dtype=torch.int32, device=dev)


def cases(dev, dtype):
    """``(name, call, exception class, message regex)``; ``call`` may return a check of its
    own (a callable that must return True after the error, e.g. the cache is unchanged)."""
    r = lambda *s, dt=dtype: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    q4, k4, v4 = r(2, 8, 4, 16), r(2, 8, 4, 16), r(2, 8, 4, 16)
    s4 = r(2, 4, 8, 16)
    out = []

    def add(name, fn, exc, needle):
        out.append((name, fn, exc, needle))

    # ---- SDPA
    add("sdpa query 1-D", lambda: scaled_dot_product_attention(r(16), s4, s4), ValueError, "query")
    add("sdpa key head dim", lambda: scaled_dot_product_attention(s4, r(2, 4, 8, 8), s4), ValueError, "head dim")
    add("sdpa batch", lambda: scaled_dot_product_attention(s4, r(3, 4, 8, 16), r(3, 4, 8, 16)), ValueError, "batch")
    add("sdpa gqa 6 vs 4", lambda: scaled_dot_product_attention(r(2, 6, 8, 16), s4, s4, enable_gqa=True), ValueError, "multiple")
    add("sdpa head dim 300", lambda: scaled_dot_product_attention(*(r(1, 2, 8, 300),) * 3), ValueError, "headdim")
    add("sdpa mixed dtype", lambda: scaled_dot_product_attention(s4.float(), s4.half(), s4.half()), TypeError, "dtype")
    add("sdpa int32", lambda: scaled_dot_product_attention(*(torch.ones(2, 4, 8, 16, dtype=torch.int32, device=dev),) * 3), TypeError, "query")
    add("sdpa float64 and float32", lambda: scaled_dot_product_attention(s4.double(), s4, s4), TypeError, "share one dtype")
    add("sdpa key on meta", lambda: scaled_dot_product_attention(s4, s4.to("meta"), s4), ValueError, "meta")
    add("sdpa mask shape", lambda: scaled_dot_product_attention(s4, s4, s4, attn_mask=r(9, 10)), ValueError, "attn_mask")
    add("sdpa mask int64", lambda: scaled_dot_product_attention(s4, s4, s4, attn_mask=torch.ones(8, 8, dtype=torch.int64, device=dev)), TypeError, "attn_mask")
    add("sdpa mask list", lambda: scaled_dot_product_attention(s4, s4, s4, attn_mask=[1]), TypeError, "attn_mask")
    add("sdpa dropout 1.5", lambda: scaled_dot_product_attention(s4, s4, s4, dropout_p=1.5), ValueError, "dropout_p")
    add("sdpa dropout nan", lambda: scaled_dot_product_attention(s4, s4, s4, dropout_p=float("nan")), ValueError, "dropout_p")
    add("sdpa dropout str", lambda: scaled_dot_product_attention(s4, s4, s4, dropout_p="0.1"), TypeError, "dropout_p")
    add("sdpa scale nan", lambda: scaled_dot_product_attention(s4, s4, s4, scale=float("nan")), ValueError, "scale")
    add("sdpa scale str", lambda: scaled_dot_product_attention(s4, s4, s4, scale="x"), TypeError, "scale")
    add("sdpa mask + causal", lambda: scaled_dot_product_attention(s4, s4, s4, attn_mask=r(8, 8), is_causal=True), ValueError, "is_causal")

    # ---- flash_attn_func and the packed forms
    add("dense q 3-D", lambda: flash_attn_func(r(8, 4, 16), k4, v4), ValueError, "q")
    add("dense k/v shapes", lambda: flash_attn_func(q4, k4, r(2, 9, 4, 16)), ValueError, "k and v")
    add("dense batch", lambda: flash_attn_func(q4, r(3, 8, 4, 16), r(3, 8, 4, 16)), ValueError, "batch")
    add("dense heads 4 vs 3", lambda: flash_attn_func(q4, r(2, 8, 3, 16), r(2, 8, 3, 16)), ValueError, "nheads")
    add("dense head dim 257", lambda: flash_attn_func(*(r(2, 8, 4, 257),) * 3), ValueError, "headdim")
    add("dense int8", lambda: flash_attn_func(*(torch.ones(2, 8, 4, 16, dtype=torch.int8, device=dev),) * 3), TypeError, "q")
    add("dense window (-2, 0)", lambda: flash_attn_func(q4, k4, v4, window_size=(-2, 0)), ValueError, "window_size")
    add("dense window (3,)", lambda: flash_attn_func(q4, k4, v4, window_size=(3,)), ValueError, "window_size")
    add("dense window (1.5, 2)", lambda: flash_attn_func(q4, k4, v4, window_size=(1.5, 2)), TypeError, "window_size")
    add("dense window None", lambda: flash_attn_func(q4, k4, v4, window_size=None), TypeError, "window_size")
    add("dense softcap -1", lambda: flash_attn_func(q4, k4, v4, softcap=-1.0), ValueError, "softcap")
    add("dense softcap nan", lambda: flash_attn_func(q4, k4, v4, softcap=float("nan")), ValueError, "softcap")
    add("dense alibi (5,)", lambda: flash_attn_func(q4, k4, v4, alibi_slopes=r(5, dt=torch.float32)), ValueError, "alibi_slopes")
    add("dense alibi fp16", lambda: flash_attn_func(q4, k4, v4, alibi_slopes=r(4, dt=torch.float16)), TypeError, "alibi_slopes")
    add("dense dropout 1.0", lambda: flash_attn_func(q4, k4, v4, dropout_p=1.0), ValueError, "dropout_p")
    add("dense scale inf", lambda: flash_attn_func(q4, k4, v4, softmax_scale=float("inf")), ValueError, "softmax_scale")
    add("qkvpacked dim2=2", lambda: flash_attn_qkvpacked_func(r(2, 8, 2, 4, 16)), ValueError, "qkv")
    add("kvpacked 4-D", lambda: flash_attn_kvpacked_func(q4, r(2, 8, 4, 16)), ValueError, "kv")

    # ---- varlen (12 packed tokens, 2 heads) and paged varlen (4 pages of 16)
    qv, kv_, vv = r(12, 2, 16), r(12, 2, 16), r(12, 2, 16)
    kp, vp = r(4, 16, 2, 16), r(4, 16, 2, 16)
    good = i32(dev, 0, 5, 12)

    def varlen(cq=good, ck=good, mq=7, mk=7, k=kv_, v=vv, **kw):
        return lambda: flash_attn_varlen_func(qv, k, v, cq, ck, mq, mk, causal=True, **kw)

    add("varlen cu int64", varlen(cq=good.long()), TypeError, "cu_seqlens_q")
    add("varlen cu not monotone", varlen(ck=i32(dev, 0, 9, 5), mk=9), ValueError, "non-decreasing")
    add("varlen cu past total", varlen(cq=i32(dev, 0, 5, 20), ck=i32(dev, 0, 5, 20), mq=15, mk=15), ValueError, "packed tokens")
    add("varlen q/k sequences", varlen(ck=i32(dev, 0, 3, 6, 12), mk=6), ValueError, "sequences")
    add("varlen cu starts at 1", varlen(cq=i32(dev, 1, 5, 12)), ValueError, "start at 0")
    add("varlen cu 2-D", varlen(cq=good[None]), ValueError, "cu_seqlens_q")
    add("varlen max_seqlen 3", varlen(mq=3), ValueError, "max_seqlen_q")
    add("varlen max_seqlen float", varlen(mq=7.0), TypeError, "max_seqlen_q")
    add("varlen cu on meta", varlen(cq=good.to("meta")), ValueError, "meta")
    add("varlen alibi (3, H)", varlen(alibi_slopes=r(3, 2, dt=torch.float32)), ValueError, "alibi_slopes")
    ck_paged = i32(dev, 0, 20, 30)
    add("paged table int64", varlen(ck=ck_paged, mk=20, k=kp, v=vp, block_table=i32(dev, 0, 1, 2, 3).reshape(2, 2).long()), TypeError, "block_table")
    add("paged entry 9 of 4", varlen(ck=ck_paged, mk=20, k=kp, v=vp, block_table=i32(dev, 0, 9, 2, 3).reshape(2, 2)), ValueError, "block_table")
    add("paged entry -1", varlen(ck=ck_paged, mk=20, k=kp, v=vp, block_table=i32(dev, 0, 1, -1, 3).reshape(2, 2)), ValueError, "block_table")
    add("paged too few columns", varlen(ck=ck_paged, mk=20, k=kp, v=vp, block_table=i32(dev, 0, 1).reshape(2, 1)), ValueError, "pages")
    add("paged page_size 10", varlen(ck=ck_paged, mk=20, k=r(4, 10, 2, 16), v=r(4, 10, 2, 16), block_table=i32(dev, 0, 1, 2, 3).reshape(2, 2)), ValueError, "page_size")
    add("paged 3 rows for batch 2", varlen(ck=ck_paged, mk=20, k=kp, v=vp, block_table=i32(dev, 0, 1, 2, 3, 0, 1).reshape(3, 2)), ValueError, "block_table")

    # ---- flash_attn_with_kvcache.  Index values are checked on the device: with the default
    # FLASHTILE_KVCACHE_CHECK=async the call returns (NaN, caches untouched) and the error comes
    # from check_kvcache_errors(); shapes, dtypes and static values raise in the call
    from flashtile.backends import select
    from flashtile.backends.triton.launch_decode import check_mode
    deferred = select(dev) == "triton" and check_mode() == "async"

    def guarded(call_kvcache, kc, vc, index_error):
        """``call_kvcache()`` then the check; passes judgement on the caches and the output."""
        before = kc.clone(), vc.clone()
        returned = []

        def call():
            returned.append(call_kvcache())
            if index_error and deferred:
                flashtile.check_kvcache_errors()
        call.unchanged = lambda: (torch.equal(kc, before[0]) and torch.equal(vc, before[1])
                                  and (not (index_error and deferred)
                                       or (len(returned) == 1 and bool(returned[0].isnan().any()))))
        return call

    def kvcache(paged=True, append=True, index_error=False, **change):
        qk = r(2, 1, 4, 16)
        if paged:
            kc, vc, bt = r(6, 16, 2, 16), r(6, 16, 2, 16), i32(dev, 0, 1, 2, 3, 4, 5).reshape(2, 3)
        else:
            kc, vc, bt = r(2, 48, 2, 16), r(2, 48, 2, 16), None
        kw = dict(cache_seqlens=i32(dev, 10, 30), block_table=bt)
        if append:
            kw.update(k=r(2, 1, 2, 16), v=r(2, 1, 2, 16))
        kw.update(change)
        return guarded(lambda: flash_attn_with_kvcache(qk, kc, vc, **kw), kc, vc, index_error)

    add("kvcache seqlens past block_table", kvcache(cache_seqlens=i32(dev, 10, 48), index_error=True), RuntimeError, "block_table")
    add("kvcache seqlens negative", kvcache(cache_seqlens=i32(dev, -1, 3), index_error=True), ValueError, "cache_seqlens")
    add("kvcache attend seqlens past block_table", kvcache(append=False, cache_seqlens=i32(dev, 10, 49), index_error=True), RuntimeError, "block_table")
    add("kvcache seqlens int64", kvcache(cache_seqlens=i32(dev, 10, 30).long()), TypeError, "cache_seqlens")
    add("kvcache seqlens length 3", kvcache(cache_seqlens=i32(dev, 1, 2, 3)), ValueError, "cache_seqlens")
    add("kvcache append int past capacity", kvcache(cache_seqlens=48), ValueError, "capacity")
    add("kvcache append past contiguous cache", kvcache(paged=False, cache_seqlens=i32(dev, 10, 48), index_error=True), ValueError, "cache_seqlens")
    add("kvcache k without v", kvcache(v=None), ValueError, "k and v")
    add("kvcache fp16 cache", kvcache(k=r(2, 1, 2, 16, dt=torch.float32 if dtype != torch.float32 else torch.float16)), TypeError, "dtype")
    add("kvcache batch_idx 5", kvcache(paged=False, cache_batch_idx=i32(dev, 0, 5), index_error=True), ValueError, "cache_batch_idx")
    add("kvcache attend batch_idx -1", kvcache(paged=False, append=False, cache_batch_idx=i32(dev, -1, 1), index_error=True), ValueError, "cache_batch_idx")
    add("kvcache leftpad 40", kvcache(paged=False, cache_leftpad=i32(dev, 0, 40), index_error=True), ValueError, "cache_leftpad")
    add("kvcache table entry 99", kvcache(block_table=i32(dev, 0, 1, 2, 3, 99, 5).reshape(2, 3), index_error=True), ValueError, "block_table")
    add("kvcache table entry -2", kvcache(block_table=i32(dev, -2, 1, 2, 3, 4, 5).reshape(2, 3), index_error=True), ValueError, "block_table")
    add("kvcache attend table entry 99, 3 splits", kvcache(append=False, num_splits=3, block_table=i32(dev, 0, 1, 2, 3, 99, 5).reshape(2, 3), index_error=True), ValueError, "block_table")
    add("kvcache float table", kvcache(block_table=torch.zeros(2, 3, device=dev)), TypeError, "block_table")
    add("kvcache num_splits -1", kvcache(num_splits=-1), ValueError, "num_splits")
    add("kvcache window (-5, -7)", kvcache(window_size=(-5, -7)), ValueError, "window_size")
    add("kvcache window 5", kvcache(window_size=5), TypeError, "window_size")
    add("kvcache softcap -2", kvcache(softcap=-2.0), ValueError, "softcap")
    add("kvcache rotary too short", kvcache(rotary_cos=r(20, 4), rotary_sin=r(20, 4), index_error=True), ValueError, "rotary_cos")
    add("kvcache rotary dim 20 > 16", kvcache(rotary_cos=r(80, 10), rotary_sin=r(80, 10)), ValueError, "rotary_dim")
    add("kvcache tree_mask (3, 3) for Sq=1", kvcache(tree_mask=torch.ones(3, 3, dtype=torch.bool, device=dev)), ValueError, "tree_mask")

    # ---- block-sparse, merge
    add("block_sparse int mask", lambda: block_sparse_attn_func(q4, k4, v4, torch.ones(1, 1, 1, 1, dtype=torch.int32, device=dev), block_size=16), TypeError, "block_mask")
    add("block_sparse block 10", lambda: block_sparse_attn_func(q4, k4, v4, torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev), block_size=10), ValueError, "block_size")
    add("block_sparse wrong count", lambda: block_sparse_attn_func(q4, k4, v4, torch.ones(1, 1, 2, 2, dtype=torch.bool, device=dev), block_size=16), ValueError, "block_mask")
    add("merge lse (B, S, H)", lambda: merge_attention_states(r(2, 3, 4, 16), r(2, 3, 4, dt=torch.float32), r(2, 3, 4, 16), r(2, 4, 3, dt=torch.float32)), ValueError, "lse_a")

    # ---- compiled calls: the value checks run inside the ops
    cvar = torch.compile(lambda q, k, v, cq, ck, mq, mk, bt: flash_attn_varlen_func(
        q, k, v, cq, ck, mq, mk, causal=True, block_table=bt), fullgraph=True, dynamic=False)
    add("compiled varlen cu not monotone", lambda: cvar(qv, kv_, vv, good, i32(dev, 0, 9, 5), 7, 9, None), ValueError, "non-decreasing")
    add("compiled varlen cu past total", lambda: cvar(qv, kv_, vv, i32(dev, 0, 5, 20), i32(dev, 0, 5, 20), 15, 15, None), ValueError, "packed tokens")
    add("compiled varlen max_seqlen 3", lambda: cvar(qv, kv_, vv, good, good, 3, 7, None), ValueError, "max_seqlen_q")
    # found while tracing: fullgraph=True reports dynamo's Unsupported error carrying the message
    add("compiled varlen cu int64", lambda: cvar(qv, kv_, vv, good.long(), good, 7, 7, None), RuntimeError, "cu_seqlens_q must be int32")
    add("compiled paged entry 99", lambda: cvar(qv, kp, vp, good, ck_paged, 7, 20, i32(dev, 0, 99, 1, 2).reshape(2, 2)), ValueError, "block_table")
    add("compiled paged entry -3", lambda: cvar(qv, kp, vp, good, ck_paged, 7, 20, i32(dev, 0, 1, -3, 2).reshape(2, 2)), ValueError, "block_table")
    ckv = torch.compile(lambda q, kc, vc, k, v, lens, bt: flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=lens, block_table=bt), fullgraph=True)

    def compiled_kvcache(lens, table):
        kc, vc = r(6, 16, 2, 16), r(6, 16, 2, 16)
        return guarded(lambda: ckv(r(2, 1, 4, 16), kc, vc, r(2, 1, 2, 16), r(2, 1, 2, 16), lens, table),
                       kc, vc, True)

    table = i32(dev, 0, 1, 2, 3, 4, 5).reshape(2, 3)
    add("compiled kvcache seqlens past block_table", compiled_kvcache(i32(dev, 10, 48), table), RuntimeError, "block_table")
    add("compiled kvcache table entry 99", compiled_kvcache(i32(dev, 10, 30), i32(dev, 0, 1, 2, 3, 99, 5).reshape(2, 3)), ValueError, "block_table")
    return out


KVCACHE_BAD_VALUES = {
    # name: (tensor to overwrite, bad value, message)
    "seqlens past block_table": ("lens", [10, 49], "block_table"),
    "seqlens negative": ("lens", [-40, 3], r"cache_seqlens\[0\]=-40"),
    "table entry 99": ("table", [[0, 1, 2], [3, 99, 5]], r"block_table\[1, 1\]=99"),
    "table entry -7": ("table", [[-7, 1, 2], [3, 4, 5]], r"block_table\[0, 0\]=-7"),
}


def _kvcache_step(dev, dtype, append: bool):
    """A paged decode step (rotary + causal when appending) on static index tensors."""
    r = lambda *s: torch.randn(*s, device=dev, dtype=dtype)  # noqa: E731
    q, kc, vc = r(2, 1, 4, 16), r(6, 16, 2, 16), r(6, 16, 2, 16)
    lens = torch.tensor([10, 30], dtype=torch.int32, device=dev)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=dev)
    kw = dict(cache_seqlens=lens, block_table=table, causal=True)
    if append:
        kw.update(k=r(2, 1, 2, 16), v=r(2, 1, 2, 16), rotary_cos=r(40, 4), rotary_sin=r(40, 4))
    return q, kc, vc, dict(lens=lens, table=table), kw


def graph_kvcache(dev, dtype) -> list[str]:
    """CUDA graphs captured with valid index tensors, replayed after bad values were copied
    into them (nothing can be checked on the host there): the replay must write nothing into
    the caches and return NaN, ``check_kvcache_errors()`` must report it, and under memcheck
    nothing may be touched out of bounds; a replay with the valid values again must work."""
    failures = []
    for append in (True, False):
        for name, (which, value, needle) in KVCACHE_BAD_VALUES.items():
            label = f"graph: kvcache {'append' if append else 'attend'} {name}"
            q, kc, vc, index, kw = _kvcache_step(dev, dtype, append)
            good = {k: t.clone() for k, t in index.items()}
            with flashtile.use_backend("triton"):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm up: compiles the kernels
                    flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **kw)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                flashtile.check_kvcache_errors()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = flash_attn_with_kvcache(q, kc, vc, **kw)
            before = kc.clone(), vc.clone()
            index[which].copy_(torch.tensor(value, dtype=torch.int32, device=dev))
            graph.replay()
            torch.cuda.synchronize()
            unchanged = torch.equal(kc, before[0]) and torch.equal(vc, before[1])
            nan = bool(out.isnan().any())
            try:
                flashtile.check_kvcache_errors()
                reported = "nothing"
                ok = False
            except flashtile.FlashtileInputError as e:
                reported = str(e).splitlines()[0][:150]
                ok = re.search(needle, str(e)) is not None and "CUDA graph" in str(e)
            for k, t in index.items():
                t.copy_(good[k])
            graph.replay()
            torch.cuda.synchronize()
            ok = ok and unchanged and nan and not bool(out.isnan().any())
            try:
                flashtile.check_kvcache_errors()
            except flashtile.FlashtileInputError:
                ok = False
            print(f"{'ok  ' if ok else 'FAIL'} {label}: cache unchanged={unchanged}, NaN output={nan}, "
                  f"reported: {reported}")
            if not ok:
                failures.append(label)
    return failures


def replayed_kvcache(dev, dtype) -> list[str]:
    """Bad index values in an eager call that replays a launch plan (a step of the same
    signature ran before with valid values): the replay skips the host checks and puts its
    partials in the stream's scratch region, so only the device check stands between the values
    and memory.  It must write nothing into the caches, return NaN and be reported by
    ``check_kvcache_errors()``; under memcheck nothing may be touched out of bounds."""
    from flashtile import kvcache
    failures = []
    for append in (True, False):
        for name, (which, value, needle) in KVCACHE_BAD_VALUES.items():
            label = f"replay: kvcache {'append' if append else 'attend'} {name}"
            q, kc, vc, index, kw = _kvcache_step(dev, dtype, append)
            with flashtile.use_backend("triton"):
                before_plans = len(kvcache._PLANS)
                for _ in range(2):  # records the plan, then replays it
                    flash_attn_with_kvcache(q, kc, vc, **kw)
                torch.cuda.synchronize()
                flashtile.check_kvcache_errors()
                planned = len(kvcache._PLANS) in (before_plans, before_plans + 1) and bool(kvcache._PLANS)
                index[which].copy_(torch.tensor(value, dtype=torch.int32, device=dev))
                before = kc.clone(), vc.clone()
                out = flash_attn_with_kvcache(q, kc, vc, **kw)
                torch.cuda.synchronize()
            unchanged = torch.equal(kc, before[0]) and torch.equal(vc, before[1])
            nan = bool(out.isnan().any())
            try:
                flashtile.check_kvcache_errors()
                reported, ok = "nothing", False
            except flashtile.FlashtileInputError as e:
                reported = str(e).splitlines()[0][:150]
                ok = re.search(needle, str(e)) is not None
            ok = ok and unchanged and nan and planned
            print(f"{'ok  ' if ok else 'FAIL'} {label}: cache unchanged={unchanged}, NaN output={nan}, "
                  f"planned={planned}, reported: {reported}")
            if not ok:
                failures.append(label)
    return failures


def unchecked_kvcache(dev, dtype) -> list[str]:
    """Bad index values with ``FLASHTILE_KVCACHE_CHECK=off`` (no check, no record): the call
    completes; under memcheck it may not touch memory out of bounds."""
    failures = []
    for append in (True, False):
        for name, (which, value, _) in KVCACHE_BAD_VALUES.items():
            label = f"check off: kvcache {'append' if append else 'attend'} {name}"
            q, kc, vc, index, kw = _kvcache_step(dev, dtype, append)
            index[which].copy_(torch.tensor(value, dtype=torch.int32, device=dev))
            with flashtile.use_backend("triton"):
                flash_attn_with_kvcache(q, kc, vc, **kw)
            torch.cuda.synchronize()
            print(f"ok   {label}: completed")
    return failures


def captured_varlen(dev, dtype) -> list[str]:
    """Bad ``cu_seqlens`` / ``block_table`` inside a captured CUDA graph (no host read is
    possible): the call runs on clamped index tensors, in bounds, with finite output."""
    failures = []
    r = lambda *s: torch.randn(*s, device=dev, dtype=dtype)  # noqa: E731
    i = lambda *v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    q, k, v, kp, vp = r(12, 2, 16), r(12, 2, 16), r(12, 2, 16), r(4, 16, 2, 16), r(4, 16, 2, 16)
    bad = {
        "cu past total": (k, v, i(0, 5, 20), i(0, 5, 20), 15, 15, None),
        "cu not monotone": (k, v, i(0, 5, 12), i(0, 9, 5), 7, 9, None),
        "page 99": (kp, vp, i(0, 5, 12), i(0, 20, 30), 7, 20, i(0, 99, 1, 2).reshape(2, 2)),
        "page -3": (kp, vp, i(0, 5, 12), i(0, 20, 30), 7, 20, i(0, 1, -3, 2).reshape(2, 2)),
    }
    for name, (kk, vv, cq, ck, mq, mk, bt) in bad.items():
        label = f"graph: varlen {name}"
        call = lambda: flash_attn_varlen_func(q, kk, vv, cq, ck, mq, mk, causal=True,  # noqa: E731
                                              block_table=bt)
        good = (i(0, 5, 12), i(0, 5, 12) if bt is None else i(0, 20, 30))
        flash_attn_varlen_func(q, kk, vv, *good, mq, mk, causal=True,
                               block_table=None if bt is None else i(0, 1, 2, 3).reshape(2, 2))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        graph.replay()
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all())
        print(f"{'ok  ' if ok else 'FAIL'} {label}: completed, finite output={ok}")
        if not ok:
            failures.append(label)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--kvcache-check", choices=["async", "sync"], default="async",
                        help="FLASHTILE_KVCACHE_CHECK for the table's kvcache calls")
    graphs = parser.add_mutually_exclusive_group()
    graphs.add_argument("--no-graphs", action="store_true",
                        help="skip the CUDA-graph cases (needed with PYTORCH_NO_CUDA_MEMORY_CACHING=1, "
                             "which lets memcheck see every tensor's own bounds)")
    graphs.add_argument("--graphs-only", action="store_true", help="only the CUDA-graph cases")
    args = parser.parse_args(argv)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    os.environ["FLASHTILE_KVCACHE_CHECK"] = args.kvcache_check
    torch.manual_seed(0)
    failures = []
    for name, fn, exc, needle in ([] if args.graphs_only else cases(dev, dtype)):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every outcome is judged below
            good = isinstance(e, exc) and re.search(needle, str(e)) is not None
            if good and exc is ValueError:
                good = isinstance(e, InputError)
            if good and hasattr(fn, "unchanged"):
                good = fn.unchanged()
            verdict = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
        else:
            good, verdict = False, "no error"
        print(f"{'ok  ' if good else 'FAIL'} {name}: {verdict}")
        if not good:
            failures.append(name)
    if dev.type == "cuda":  # CPU tensors: the torch backend checks on the host
        os.environ["FLASHTILE_KVCACHE_CHECK"] = "async"
        if not args.no_graphs:
            failures += captured_varlen(dev, dtype)
            failures += graph_kvcache(dev, dtype)
        if not args.graphs_only:
            failures += replayed_kvcache(dev, dtype)
            os.environ["FLASHTILE_KVCACHE_CHECK"] = "off"
            failures += unchecked_kvcache(dev, dtype)
    print(f"{len(failures)} failed" + (": " + ", ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
