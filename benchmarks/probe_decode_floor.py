"""What bounds a batch-1 decode step (GPU): ``python benchmarks/probe_decode_floor.py OUT.json``.

Batch 1, nheads 32 / nheads_k 8, d=128, bf16, one query token.  Everything is replayed from a
CUDA graph and timed as ``python -m flashtile.bench decode`` times it (events around the
replay, a 256 MB read before each one to empty L2).  Measured:

- the cost of the method itself: a graph of one (and of two) kernels that store one value;
- the best plain read of the K/V cache's byte count (a Triton reduction over grids of 1 to 64
  programs per SM) and ``torch.sum``: the floor for one isolated step;
- flashtile's step over split counts, the split kernel alone, and cuDNN;
- GPU-side spans from the profiler (first kernel start to last kernel end of one step), which
  leave out the launch latency that events include;
- a model's decode step: one graph of ``L`` layers, each attending to its own cache, timed per
  layer (flashtile, cuDNN, and the plain read of each layer's bytes).

The committed ``benchmarks/results/probe_decode_floor_h100.json`` also has ``flashtile_pdl`` rows:
they came from an experiment not kept (a ``USE_PDL`` flag on the split and combine kernels, the
combine launched with ``launch_pdl=True`` and waiting with ``griddepcontrol.wait``), measured
with the earlier split rule (33 splits at 16K).
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import flashtile
import flashtile.decode
from flashtile import bench_decode as bd
from flashtile.backends.triton import launch_decode

H, HK, D, DT = 32, 8, 128, torch.bfloat16
# the launch internals are patched below: replaying a recorded eager call would bypass that
flashtile.decode.EAGER_PLANS = False


@triton.jit
def _touch(x_ptr):
    tl.store(x_ptr, 1)


@triton.jit
def _read(x_ptr, out_ptr, n, n_per_prog, BLOCK: tl.constexpr):
    """``out[p] = sum(x[p * n_per_prog : (p + 1) * n_per_prog])`` in float32."""
    i_p = tl.program_id(0)
    base = i_p.to(tl.int64) * n_per_prog
    b_acc = tl.zeros([BLOCK], tl.float32)  # [BLOCK]
    for i in range(0, n_per_prog, BLOCK):
        o = base + i + tl.arange(0, BLOCK)  # [BLOCK]
        b_acc += tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + i_p, tl.sum(b_acc, 0))


@triton.jit
def _l2_flush(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """A read of ``x`` (one tile per program) under a name of its own, so the profiler can
    leave it out."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + o, mask=o < n, other=0.0), 0))


def reader(x, grid, block, warps):
    n = x.numel()
    per = triton.cdiv(triton.cdiv(n, grid), block) * block
    out = torch.empty(grid, device=x.device, dtype=torch.float32)
    return lambda: _read[(grid,)](x, out, n, per, BLOCK=block, num_warps=warps)


def graph_ms(fn):
    graph, _ = bd.capture(fn)
    ms = bd.bench_ms(graph.replay, 10, 60)
    return ms, graph


def gpu_span_us(graph, reps=30):
    """Median GPU-side span of one replay: first kernel start to last kernel end (profiler)."""
    flush_buf = torch.empty(64 << 20, device="cuda", dtype=torch.float32).normal_()
    flush_out = torch.empty(triton.cdiv(flush_buf.numel(), 4096), device="cuda", dtype=torch.float32)

    def flush():
        _l2_flush[(flush_out.numel(),)](flush_buf, flush_out, flush_buf.numel(), BLOCK=4096)

    flush()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    spans, busy, cur = [], [], None
    for e in kernels:
        if "_l2_flush" in e.name:
            if cur:
                spans.append(cur[1] - cur[0])
                busy.append(cur[2])
            cur = None
            continue
        s, t = e.time_range.start, e.time_range.end
        cur = [s, t, t - s] if cur is None else [cur[0], max(cur[1], t), cur[2] + t - s]
    if cur:
        spans.append(cur[1] - cur[0])
        busy.append(cur[2])
    names = sorted({e.name[:60] for e in kernels if "_l2_flush" not in e.name})
    return (statistics.median(spans) if spans else None,
            statistics.median(busy) if busy else None, names)


def main(path):
    rows = []
    nbytes_of = lambda cache: 2 * cache * HK * D * 2  # noqa: E731

    def rec(name, cache, ms, graph=None, layers=1, **extra):
        r = dict(impl=name, cache=cache, layers=layers, ms=ms, **extra)
        if ms:
            r["GBps"] = nbytes_of(cache) * layers / (ms * 1e-3) / 1e9
            r["frac_of_copy"] = r["GBps"] / copy_bw
        if graph is not None and layers == 1:
            r["gpu_span_us"], r["gpu_busy_us"], r["kernels"] = gpu_span_us(graph)
        rows.append(r)
        span = f"  span {r['gpu_span_us']:6.1f} us busy {r['gpu_busy_us']:6.1f} us" if r.get("gpu_span_us") else ""
        frac = f"{100 * r['frac_of_copy']:5.1f}%" if ms else "  -  "
        print(f"{name:<34} cache {cache:>6} L {layers:>2} {1e3 * ms / layers if ms else 0:8.2f} us/layer "
              f"{frac} of copy{span} {extra if extra else ''}", flush=True)

    copy_bw = bd.copy_bandwidth(10, 100)
    print(f"copy bandwidth {copy_bw:.1f} GB/s", flush=True)
    rows.append(dict(impl="copy_bandwidth_GBps", value=copy_bw))

    one = torch.zeros(1, device="cuda", dtype=torch.int32)
    ms, g = graph_ms(lambda: _touch[(1,)](one))
    rec("empty_kernel", 0, ms, g)
    ms, g = graph_ms(lambda: (_touch[(1,)](one), _touch[(1,)](one)))
    rec("two_empty_kernels", 0, ms, g)

    for cache in (16384, 65536):
        src = torch.empty(nbytes_of(cache) // 2, device="cuda", dtype=DT).normal_()
        sink = torch.empty((), device="cuda", dtype=torch.float32)
        ms, g = graph_ms(lambda: torch.sum(src, 0, dtype=torch.float32, out=sink))
        rec("torch_sum", cache, ms, g)
        for grid in (132, 264, 528, 1056, 2112, 4224, 8448):
            for block, warps in ((4096, 4), (8192, 8)):
                ms, g = graph_ms(reader(src, grid, block, warps))
                rec("triton_read", cache, ms, g, grid=grid, block=block, warps=warps)
        del src, g
        bd.cleanup()

        q = torch.randn(1, 1, H, D, device="cuda", dtype=DT)
        kc, vc = (torch.randn(1, cache, HK, D, device="cuda", dtype=DT) for _ in range(2))
        lens = torch.full((1,), cache, dtype=torch.int32, device="cuda")
        step = lambda s=0: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=s)  # noqa: E731
        ms, g = graph_ms(step)
        rec("flashtile", cache, ms, g, splits=launch_decode.default_num_splits(q, HK, cache))
        for s in (16, 24, 48, 66, 128):
            ms, g = graph_ms(lambda s=s: step(s))
            rec("flashtile", cache, ms, g, splits=s)
        real_merge = launch_decode._merge
        launch_decode._merge = lambda *a, **k: None
        ms, g = graph_ms(lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))
        rec("split_kernel_only", cache, ms, g)
        launch_decode._merge = real_merge
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            try:
                ms, g = graph_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
                rec("sdpa_cudnn", cache, ms, g)
            except Exception as exc:  # cuDNN may refuse a shape: record it and go on
                rec("sdpa_cudnn", cache, None, status=f"{type(exc).__name__}: {exc}"[:200])
        del q, kc, vc, g
        bd.cleanup()

    # a model's decode step: L layers, each with its own cache, captured in one graph
    for cache, layers in ((4096, 32), (16384, 32), (65536, 16)):
        qs = [torch.randn(1, 1, H, D, device="cuda", dtype=DT) for _ in range(layers)]
        kcs = [torch.randn(1, cache, HK, D, device="cuda", dtype=DT) for _ in range(layers)]
        vcs = [torch.randn(1, cache, HK, D, device="cuda", dtype=DT) for _ in range(layers)]
        lens = torch.full((1,), cache, dtype=torch.int32, device="cuda")
        ms, g = graph_ms(lambda: [flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
                                  for q, k, v in zip(qs, kcs, vcs)])
        rec("model_flashtile", cache, ms, layers=layers)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            try:
                ms, g = graph_ms(lambda: [F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
                    for q, k, v in zip(qs, kcs, vcs)])
                rec("model_sdpa_cudnn", cache, ms, layers=layers)
            except Exception as exc:
                rec("model_sdpa_cudnn", cache, None, layers=layers, status=f"{type(exc).__name__}: {exc}"[:200])
        # the floor: read each layer's K and V (two reads of half the bytes per layer)
        fns = [reader(t.view(-1), 264, 8192, 8) for t in kcs + vcs]
        ms, g = graph_ms(lambda: [f() for f in fns])
        rec("model_read_same_bytes", cache, ms, layers=layers)
        del qs, kcs, vcs, g, fns
        bd.cleanup()

    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
                       command="python benchmarks/probe_decode_floor.py OUT.json", rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_decode_floor.json")
