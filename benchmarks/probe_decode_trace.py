"""When do the programs of a batch-1, 16K split kernel start and finish? (GPU):
``python benchmarks/probe_decode_trace.py OUT.json``.

Every program of a probe split kernel (the recurrence of ``probe_decode_stripped.py``, full
tiles, pointer loads) and of a plain read (8 KB per program) writes ``globaltimer`` at its
start, after its first key tile, and at its end, plus the SM it ran on.  One CUDA-graph replay
after L2 is emptied is traced (the last of several); rows give the kernel span, the spread of
program start times, the first-tile latency, and the spread of end times, next to the replay's
event time taken as the decode bench takes it.
"""
import json
import sys
import time

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc

from flashtile.bench_decode import _flush_buffers, capture, graph_ms

sys.path.insert(0, __file__.rsplit("/", 1)[0])


@triton.jit
def _traced_split(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, trace_ptr, n_keys, stride_ks, stride_kh, n_splits, scale,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``probe_decode_stripped._stripped_kernel`` (pointer loads, math) with timestamps."""
    t_start = tlc.globaltimer()
    i_hk = tl.program_id(0)
    i_split = tl.program_id(1)
    n_tiles = n_keys // BLOCK_N
    per = (n_tiles + n_splits - 1) // n_splits
    lo = i_split * per
    hi = tl.minimum(lo + per, n_tiles)
    o_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_m = o_m < GROUP
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    o_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    b_q = tl.load(q_ptr + (i_hk * GROUP + o_m[:, None]) * BLOCK_D + o_d[None, :], mask=m_m[:, None], other=0.0)
    p_k = k_ptr + (lo * BLOCK_N + o_n[:, None]).to(tl.int64) * stride_ks + i_hk * stride_kh + o_d[None, :]
    p_v = v_ptr + (lo * BLOCK_N + o_n[:, None]).to(tl.int64) * stride_ks + i_hk * stride_kh + o_d[None, :]
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M]
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M]
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # [BLOCK_M, BLOCK_D]
    t_first = t_start
    for i_tile in range(lo, hi):
        b_k = tl.load(p_k)  # [BLOCK_N, BLOCK_D]
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale  # [BLOCK_M, BLOCK_N]
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
        b_p = tl.exp2(b_s - b_m_new[:, None])  # [BLOCK_M, BLOCK_N]
        b_alpha = tl.exp2(b_m - b_m_new)  # [BLOCK_M]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(p_v)  # [BLOCK_N, BLOCK_D]
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        b_m = b_m_new
        p_k += BLOCK_N * stride_ks
        p_v += BLOCK_N * stride_ks
        # the sum ties the timestamp to this tile's math, so it is taken after it
        t_now = tlc.globaltimer() + (tl.sum(b_l, 0) < 0).to(tl.int64)
        t_first = tl.where(i_tile == lo, t_now, t_first)
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]  # [BLOCK_M, BLOCK_D]
    o_row = i_split * (tl.num_programs(0) * GROUP) + i_hk * GROUP + o_m  # [BLOCK_M]
    tl.store(o_ptr + o_row[:, None] * BLOCK_D + o_d[None, :], b_o, mask=m_m[:, None])
    tl.store(lse_ptr + o_row, b_m + tl.log2(b_l), mask=m_m)
    t_end = tlc.globaltimer()
    i_p = i_split * tl.num_programs(0) + i_hk
    tl.store(trace_ptr + i_p * 4 + 0, t_start)
    tl.store(trace_ptr + i_p * 4 + 1, t_first)
    tl.store(trace_ptr + i_p * 4 + 2, t_end)
    tl.store(trace_ptr + i_p * 4 + 3, tlc.smid().to(tl.int64))


@triton.jit
def _traced_read(x_ptr, out_ptr, trace_ptr, n, BLOCK: tl.constexpr):
    """``bench_decode._read_kernel`` with timestamps."""
    t_start = tlc.globaltimer()
    i_p = tl.program_id(0)
    o = i_p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    b_x = tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)  # [BLOCK]
    s = tl.sum(b_x, 0)
    t_first = tlc.globaltimer() + (s < -1e30).to(tl.int64)
    tl.store(out_ptr + i_p, s)
    t_end = tlc.globaltimer()
    tl.store(trace_ptr + i_p * 4 + 0, t_start)
    tl.store(trace_ptr + i_p * 4 + 1, t_first)
    tl.store(trace_ptr + i_p * 4 + 2, t_end)
    tl.store(trace_ptr + i_p * 4 + 3, tlc.smid().to(tl.int64))


def summarise(trace):
    t = trace.cpu().double()
    t0 = t[:, 0].min()
    start, first, end = (t[:, 0] - t0) / 1e3, (t[:, 1] - t[:, 0]) / 1e3, (t[:, 2] - t0) / 1e3
    dur = end - start
    q = lambda x: [round(float(v), 2) for v in torch.quantile(x, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=x.dtype))]  # noqa: E731
    sms = t[:, 3].long()
    per_sm = torch.bincount(sms, minlength=132)
    return dict(programs=t.shape[0], span_us=round(float(end.max()), 2), start_q=q(start),
                first_tile_us_q=q(first), end_q=q(end), duration_q=q(dur),
                sms_used=int((per_sm > 0).sum()), programs_per_sm_max=int(per_sm.max()))


def traced_ms(fn, trace):
    """Event time of ``fn`` replayed from a graph, then one more replay after an L2 flush, traced."""
    ms = graph_ms(fn)
    graph, _ = capture(fn)
    buf, sink = _flush_buffers()
    for _ in range(3):
        torch.sum(buf, 0, out=sink)
        graph.replay()
    torch.cuda.synchronize()
    return ms, summarise(trace)


def main(path):
    h, hk, d, dt, cache = 32, 8, 128, torch.bfloat16, 16384
    rows = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command="python benchmarks/probe_decode_trace.py OUT.json")
    q = torch.randn(1, 1, h, d, device="cuda", dtype=dt)
    kc, vc = (torch.randn(1, cache, hk, d, device="cuda", dtype=dt) for _ in range(2))
    nbytes = 2 * kc.numel() * kc.element_size()

    src = torch.randn(nbytes // 2, device="cuda", dtype=dt)
    block = 4096
    grid = src.numel() // block
    out = torch.empty(grid, device="cuda", dtype=torch.float32)
    trace = torch.zeros(grid, 4, device="cuda", dtype=torch.int64)
    ms, s = traced_ms(lambda: _traced_read[(grid,)](src, out, trace, src.numel(), BLOCK=block, num_warps=4), trace)
    rows.append(dict(impl="read_same_bytes_traced", ms=ms, **s))
    print(json.dumps(rows[-1]), flush=True)
    del src
    for splits, block_n, warps, stages in ((16, 64, 4, 3), (16, 64, 4, 2), (33, 64, 4, 3), (64, 64, 4, 1),
                                           (64, 32, 2, 3), (128, 64, 4, 2)):
        o = torch.empty(splits, h, d, device="cuda", dtype=torch.float32)
        lse = torch.empty(splits, h, device="cuda", dtype=torch.float32)
        trace = torch.zeros(splits * hk, 4, device="cuda", dtype=torch.int64)
        fn = lambda: _traced_split[(hk, splits)](q, kc, vc, o, lse, trace, cache, hk * d, d, splits, 0.1275,  # noqa: E731
                                                 GROUP=h // hk, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=d,
                                                 num_warps=warps, num_stages=stages)
        ms, s = traced_ms(fn, trace)
        rows.append(dict(impl="split_traced", splits=splits, block_n=block_n, warps=warps, stages=stages, ms=ms, **s))
        print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r["GBps"] = nbytes / r["ms"] / 1e6
    with open(path, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_decode_trace.json")
