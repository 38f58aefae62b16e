"""Decode on the GPU: contiguous, paged and append+rotary steps against the torch oracle, CUDA
graph replays against eager calls, and eager launch plans against Triton's own launch path.

CUDA only: run with ``TRITON_INTERPRET=0 python -m pytest tests/gpu``.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.spec import AttnSpec
from flashtile.bench.decode import capture, rotary_tables
from flashtile.reference.torch_ref import reference, rope

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET=0)"),
]

B, CAP, H, HK, D, PAGE = 3, 2048, 32, 8, 128, 64
TOL = 2e-2  # bf16 output against a float32 oracle


def _oracle(q, k, v):
    """float32 attention of q ``(1, Sq, H, D)`` over all of k/v, bottom-right causal."""
    spec = AttnSpec(D ** -0.5, window_right=0, bottom_right=True)
    return reference(q, k, v, spec, dtype=torch.float32)


@pytest.fixture
def cache():
    torch.manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(B, 1, H, D, device="cuda", dtype=dt)
    kc = torch.randn(B, CAP, HK, D, device="cuda", dtype=dt)
    vc = torch.randn(B, CAP, HK, D, device="cuda", dtype=dt)
    lens = torch.tensor([CAP, 1000, 1], dtype=torch.int32, device="cuda")
    per = CAP // PAGE
    perm = torch.randperm(B * per, device="cuda")
    kp = torch.empty(B * per, PAGE, HK, D, device="cuda", dtype=dt)
    vp = torch.empty_like(kp)
    kp[perm] = kc.reshape(B * per, PAGE, HK, D)
    vp[perm] = vc.reshape(B * per, PAGE, HK, D)
    table = perm.reshape(B, per).to(torch.int32)
    return dict(q=q, kc=kc, vc=vc, lens=lens, kp=kp, vp=vp, table=table)


def test_contiguous_and_paged_decode_match_the_oracle(cache):
    q, kc, vc, lens = cache["q"], cache["kc"], cache["vc"], cache["lens"]
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    for i in range(B):
        n = int(lens[i])
        err = (out[i:i + 1].float() - _oracle(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n]))
        assert err.abs().max().item() < TOL, f"contiguous, sequence {i}"
    out_p = flash_attn_with_kvcache(q, cache["kp"], cache["vp"], cache_seqlens=lens,
                                    block_table=cache["table"])
    assert (out_p.float() - out.float()).abs().max().item() < TOL


def test_append_rotary_step_graph_replay_equals_eager_and_oracle(cache):
    """Three decode steps with append + rotary: eager on one cache copy, a CUDA-graph replay on
    another; the replay equals the eager call bitwise (outputs and caches), and the eager call
    matches the oracle on the rotated, appended cache."""
    q, kc, vc = cache["q"], cache["kc"], cache["vc"]
    cos, sin = rotary_tables(CAP, D, "cuda")
    lens0 = torch.tensor([100, 1500, 0], dtype=torch.int32, device="cuda")
    k_eager, v_eager = kc.clone(), vc.clone()
    k_graph, v_graph = kc.clone(), vc.clone()
    s_q = torch.empty_like(q)
    s_k = torch.empty(B, 1, HK, D, device="cuda", dtype=q.dtype)
    s_v = torch.empty_like(s_k)
    s_lens = lens0.clone()

    def step():
        return flash_attn_with_kvcache(s_q, k_graph, v_graph, s_k, s_v, rotary_cos=cos,
                                       rotary_sin=sin, cache_seqlens=s_lens, causal=True)

    s_q.normal_(), s_k.normal_(), s_v.normal_()
    graph, g_out = capture(step)
    k_graph.copy_(kc), v_graph.copy_(vc)  # the capture's warm-up appended to k_graph
    for t in range(3):
        qt, kt, vt = torch.randn_like(q), torch.randn_like(s_k), torch.randn_like(s_v)
        cur = lens0 + t
        k_before = k_eager.clone()
        e_out = flash_attn_with_kvcache(qt, k_eager, v_eager, kt, vt, rotary_cos=cos,
                                        rotary_sin=sin, cache_seqlens=cur, causal=True)
        s_q.copy_(qt), s_k.copy_(kt), s_v.copy_(vt), s_lens.copy_(cur)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g_out, e_out), f"step {t}: graph replay differs from the eager call"
        for i in range(B):
            n = int(cur[i])
            pos = cur[i:i + 1].long()[:, None]
            kk = torch.cat([k_before[i:i + 1, :n], rope(kt[i:i + 1], cos, sin, pos).to(q.dtype)], 1)
            vv = torch.cat([v_eager[i:i + 1, :n], vt[i:i + 1]], dim=1)
            want = _oracle(rope(qt[i:i + 1], cos, sin, pos).to(q.dtype), kk, vv)
            err = (e_out[i:i + 1].float() - want).abs().max().item()
            assert err < TOL, f"step {t}, sequence {i}: error {err:.3e} against the oracle"
    assert torch.equal(k_graph, k_eager) and torch.equal(v_graph, v_eager)


def _decode_module():
    name = "flashtile.kvcache" if importlib.util.find_spec("flashtile.kvcache") else "flashtile.decode"
    return importlib.import_module(name)


@pytest.mark.parametrize("variant", ["attend", "paged", "append_rotary_causal",
                                     "splits5_window_softcap"])
def test_eager_plans_equal_triton_launch_bitwise(cache, variant, monkeypatch):
    """The first call records a launch plan, the next ones replay it: outputs and appended
    caches equal those of Triton's own launch path bit for bit."""
    from flashtile.backends.triton.fastlaunch import direct_launches

    decode_mod = _decode_module()
    cos, sin = rotary_tables(CAP, D, "cuda")
    k1 = torch.randn(B, 1, HK, D, device="cuda", dtype=torch.bfloat16)
    v1 = torch.randn_like(k1)
    kw = {"attend": {}, "paged": {},
          "append_rotary_causal": dict(k=k1, v=v1, rotary_cos=cos, rotary_sin=sin, causal=True),
          "splits5_window_softcap": dict(num_splits=5, window_size=(300, 0), softcap=20.0)}[variant]
    paged = variant == "paged"
    lens = cache["lens"] if "k" not in kw else torch.tensor([101, 1501, 1], dtype=torch.int32,
                                                                device="cuda")
    results = []
    for mode in ("generic", "record", "replay", "replay"):
        kc, vc = ((cache["kp"].clone(), cache["vp"].clone()) if paged
                  else (cache["kc"].clone(), cache["vc"].clone()))
        extra = dict(block_table=cache["table"]) if paged else {}
        if mode == "record":
            decode_mod._PLANS.clear()
        n_plans = len(decode_mod._PLANS)
        with direct_launches(mode != "generic"):
            out = flash_attn_with_kvcache(cache["q"], kc, vc, cache_seqlens=lens, **extra, **kw)
        torch.cuda.synchronize()
        if mode == "record":
            assert len(decode_mod._PLANS) == n_plans + 1, "the first direct call records a plan"
        results.append((out, kc, vc))
    for out, kc, vc in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(kc, results[0][1]) and torch.equal(vc, results[0][2])


def test_threads_replaying_on_one_stream_get_their_own_results(cache):
    """Two threads replay decode plans (split-KV with a combine, so partials in the scratch
    region) on the same stream at once, each on its own query and cache rows: each result
    equals the same call made alone, bit for bit."""
    import threading

    q2 = torch.randn_like(cache["q"])
    jobs = [(cache["q"], cache["kc"], cache["vc"]), (q2, cache["vc"], cache["kc"])]
    lens = cache["lens"]
    alone = [flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=4) for q, k, v in jobs]
    torch.cuda.synchronize()
    results, errors = [[], []], []

    def work(i):
        try:
            q, k, v = jobs[i]
            for _ in range(200):
                results[i].append(flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=4))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors
    for i in range(2):
        assert len(results[i]) == 200
        assert all(torch.equal(out, alone[i]) for out in results[i]), f"thread {i}"


# --------------------------------------------------------------------------------------------
# index checks without a host wait: records written by the kernels into pinned host memory
# --------------------------------------------------------------------------------------------
def _paged_step(cache, append: bool):
    """Arguments of a paged decode step on copies of the cache (``(kp, vp, kwargs)``)."""
    kw = dict(cache_seqlens=torch.tensor([100, 1500, 1], dtype=torch.int32, device="cuda"),
              block_table=cache["table"].clone(), causal=True)
    if append:
        k1 = torch.randn(B, 1, HK, D, device="cuda", dtype=torch.bfloat16)
        kw.update(k=k1, v=torch.randn_like(k1))
    return cache["kp"].clone(), cache["vp"].clone(), kw


@pytest.fixture
def fresh_errors(monkeypatch):
    monkeypatch.delenv("FLASHTILE_KVCACHE_CHECK", raising=False)
    monkeypatch.delenv("FLASHTILE_CHECK_INDICES", raising=False)
    import flashtile
    torch.cuda.synchronize()
    flashtile.check_kvcache_errors()
    return flashtile


@pytest.mark.parametrize("path", ["fused", "check-kernel"])
@pytest.mark.parametrize("append", [True, False], ids=["append", "attend"])
def test_async_error_raised_at_a_later_call(cache, fresh_errors, monkeypatch, append, path):
    """Default mode on the GPU, through a launch plan: the bad call returns NaN without waiting
    and writes nothing; once it has run, the next call raises it (argument, row, value) before
    launching anything; the calls after that are valid and report nothing."""
    flashtile = fresh_errors
    from flashtile.backends.triton import launch_decode

    if path == "check-kernel":
        monkeypatch.setattr(launch_decode, "FUSED_CHECK_BUDGET", 0)
    kp, vp, kw = _paged_step(cache, append)
    for _ in range(2):  # the second call replays the plan the first one recorded
        flash_attn_with_kvcache(cache["q"], kp.clone(), vp.clone(), **kw)
    bad_table = kw["block_table"].clone()
    bad_table[1, 3] = kp.shape[0] + 7
    k_bad, v_bad = kp.clone(), vp.clone()
    out = flash_attn_with_kvcache(cache["q"], k_bad, v_bad, **{**kw, "block_table": bad_table})
    torch.cuda.synchronize()
    assert torch.equal(k_bad, kp) and torch.equal(v_bad, vp)
    assert out[1].isnan().all()
    if append:
        assert out.isnan().all()
    else:
        assert not out[0].isnan().any() and not out[2].isnan().any()
    k_next = kp.clone()
    with pytest.raises(flashtile.FlashtileInputError,
                       match=rf"earlier .*block_table\[1, 3\]={kp.shape[0] + 7} is not a page"):
        flash_attn_with_kvcache(cache["q"], k_next, vp.clone(), **kw)
    torch.cuda.synchronize()
    assert torch.equal(k_next, kp), "the raising call ran"
    out = flash_attn_with_kvcache(cache["q"], kp.clone(), vp.clone(), **kw)
    flashtile.check_kvcache_errors()
    assert not out.isnan().any()


def test_async_error_after_the_ring_wrapped(cache, fresh_errors):
    """Three rings' worth of valid calls back to back (the host waits for the oldest record
    when the ring is full, never for the whole queue), then a bad one: reported once, by
    ``check_kvcache_errors``."""
    flashtile = fresh_errors
    from flashtile.backends.triton import launch_decode

    kp, vp, kw = _paged_step(cache, False)
    for _ in range(3 * launch_decode._Ring.SLOTS):
        flash_attn_with_kvcache(cache["q"], kp, vp, **kw)
    bad = kw["cache_seqlens"].clone()
    bad[2] = -5
    flash_attn_with_kvcache(cache["q"], kp, vp, **{**kw, "cache_seqlens": bad})
    with pytest.raises(flashtile.FlashtileInputError, match=r"cache_seqlens\[2\]=-5"):
        flashtile.check_kvcache_errors()
    flashtile.check_kvcache_errors()


def test_sync_mode_raises_in_the_call(cache, fresh_errors, monkeypatch):
    """``FLASHTILE_KVCACHE_CHECK=sync``: flash-attn's behaviour (a ``RuntimeError`` from the
    call itself), the cache untouched."""
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "sync")
    kp, vp, kw = _paged_step(cache, True)
    flash_attn_with_kvcache(cache["q"], kp.clone(), vp.clone(), **kw)
    k_bad = kp.clone()
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(cache["q"], k_bad, vp.clone(),
                                **{**kw, "cache_seqlens": torch.tensor([100, CAP, 1], dtype=torch.int32,
                                                                       device="cuda")})
    assert torch.equal(k_bad, kp)
    fresh_errors.check_kvcache_errors()


@pytest.mark.parametrize("append", [True, False], ids=["append", "attend"])
def test_graph_replay_with_bad_indices_is_reported(cache, fresh_errors, append):
    """Captured with valid index tensors, replayed after a bad value was copied in: the replay
    writes nothing and returns NaN, ``check_kvcache_errors`` reports it (once); a replay with
    the valid values again reports nothing and matches the eager call."""
    flashtile = fresh_errors
    kp, vp, kw = _paged_step(cache, append)
    k0, v0 = kp.clone(), vp.clone()
    graph, out = capture(lambda: flash_attn_with_kvcache(cache["q"], kp, vp, **kw))
    flashtile.check_kvcache_errors()
    kp.copy_(k0), vp.copy_(v0)
    lens = kw["cache_seqlens"]
    good = lens.clone()
    lens[1] = CAP + 5
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kp, k0) and torch.equal(vp, v0)
    assert out[1].isnan().all()
    with pytest.raises(flashtile.FlashtileInputError,
                       match=rf"captured in a CUDA graph .*cache_seqlens\[1\]={CAP + 5}"):
        flashtile.check_kvcache_errors()
    flashtile.check_kvcache_errors()
    lens.copy_(good)
    graph.replay()
    torch.cuda.synchronize()
    flashtile.check_kvcache_errors()
    want = flash_attn_with_kvcache(cache["q"], k0.clone(), v0.clone(), **kw)
    assert torch.equal(out, want)


_TILE_CASES = [(d, dt, b, sq, page) for d in (64, 128, 256) for dt in ("bf16", "fp32")
               for b in (2, 32) for sq, page in ((1, 0), (1, 256), (1, 64), (16, 0), (16, 256))
               if dt == "bf16" or (sq, page) == (1, 0)] + [(128, "fp16", 2, 1, 0)]


@pytest.mark.parametrize("d,dt,batch,sq,page", _TILE_CASES,
                         ids=[f"d{d}-{dt}-b{b}-sq{sq}-page{p}" for d, dt, b, sq, p in _TILE_CASES])
def test_every_tile_shape_matches_the_oracle(d, dt, batch, sq, page):
    """Each tile shape the launcher picks (programs alone on an SM at batch 2, sharing one at
    batch 32; 1 or 64 query rows; contiguous, 256- and 64-slot pages; bf16 / fp16 / fp32)
    against the float64 oracle by flash-attn's rule (2x the same-dtype oracle's error)."""
    from flashtile.backends.triton.fastlaunch import poison_outputs

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    cap, hk, h = 2048, 8, 32
    g = torch.Generator(device="cuda").manual_seed(hash((d, dt, batch, sq, page)) % 2 ** 31)
    q = torch.randn(batch, sq, h, d, device="cuda", dtype=dtype, generator=g)
    kc = torch.randn(batch, cap, hk, d, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(batch, cap, hk, d, device="cuda", dtype=dtype, generator=g)
    lens = torch.randint(sq, cap + 1, (batch,), device="cuda", dtype=torch.int32, generator=g)
    lens[0] = cap
    kw = {}
    kk, vv = kc, vc
    if page:
        per = cap // page
        perm = torch.randperm(batch * per, device="cuda", generator=g)
        kk = torch.empty(batch * per, page, hk, d, device="cuda", dtype=dtype)
        vv = torch.empty_like(kk)
        kk[perm] = kc.reshape(batch * per, page, hk, d)
        vv[perm] = vc.reshape(batch * per, page, hk, d)
        kw["block_table"] = perm.reshape(batch, per).to(torch.int32)
    with poison_outputs():
        out = flash_attn_with_kvcache(q, kk, vv, cache_seqlens=lens, causal=True, **kw)
    spec = AttnSpec(d ** -0.5, window_right=0, bottom_right=True)
    for i in range(batch):
        n = int(lens[i])
        args = (q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], spec)
        want = reference(*args, dtype=torch.float64)
        base = (reference(*args, dtype=dtype).double() - want).abs().max().item()
        err = (out[i:i + 1].double() - want).abs().max().item()
        assert err <= 2 * base + 1e-6, f"sequence {i} ({n} keys): {err:.3e} > 2 x {base:.3e}"


_RESIDENT_CASES = [(d, dt, b) for d in (64, 128, 256) for dt in ("bf16", "fp16", "fp32")
                   for b in (2, 64)]


@pytest.mark.parametrize("d,dt,batch", _RESIDENT_CASES,
                         ids=[f"d{d}-{dt}-b{b}" for d, dt, b in _RESIDENT_CASES])
def test_resident_programs_never_exceed_what_the_compiled_kernel_allows(d, dt, batch):
    """The split-KV kernel compiled for a contiguous cache (programs alone on an SM at batch
    2, sharing one at batch 64): ``resident_programs`` from the launch's tile is at most the
    programs an SM holds by the compiled kernel's shared memory (plus 1 KB a block) and by
    its registers, so the full-wave rule of ``choose_num_splits`` never counts slots the GPU
    does not have."""
    from flashtile.backends.triton import fastlaunch
    from flashtile.backends.triton import launch_decode as ld

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    q = torch.randn(batch, 1, 32, d, device="cuda", dtype=dtype)
    kc = torch.randn(batch, 1024, 8, d, device="cuda", dtype=dtype)
    lens = torch.full((batch,), 1024, device="cuda", dtype=torch.int32)
    # (plans off: a recorded plan would take the launches into a recorder of its own)
    with fastlaunch.launch_plans(False), fastlaunch.recording() as rec:
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens)
    compiled = [launched[0] for kernel, _, launched in rec.launches
                if kernel is ld._split_kv_kernel and launched is not None]
    assert compiled, "no direct launch of the split-KV kernel was recorded"
    kernel = compiled[0]
    bm, bn, bd, warps, stages, _, _ = ld._plan(True, d, 1, 4, dtype, batch, 8, 1024,
                                                ld.num_sms(q.device), 0)
    sm = ld.sm_shared_bytes(q.device)
    by_shared = sm // (kernel.metadata.shared + 1024)
    regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * kernel.metadata.num_warps)
    assert kernel.metadata.num_warps == warps and kernel.metadata.num_stages == stages
    assert ld.resident_programs(bm, bn, bd, stages, dtype.itemsize, sm) <= min(by_shared, by_regs)
