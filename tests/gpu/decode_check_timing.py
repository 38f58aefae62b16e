"""Decode-step cost of ``flash_attn_with_kvcache``'s index checks on a CUDA GPU.

Eager decode steps run back to back (the host launches step after step without waiting, as a
serving loop does; the time per step is the larger of host and GPU time), bf16, 32 query / 8 KV
heads, d=128, a 16K-key cache, batch 1 and 8, contiguous and paged (64-slot pages), with an
appended token and without, under each ``FLASHTILE_KVCACHE_CHECK`` mode:

* ``off``: no check (the kernels' guards only): the reference;
* ``async`` (the default): checked on the device, error raised at a later call;
* ``sync``: the call waits for its own check (flash-attn's behaviour).

The eager steps' GPU time is timed too (the host queues the steps while a sleep kernel holds
the GPU, so the host's pace drops out): at batch 1 the back-to-back time is the host's, and the
two columns together say which side a check's cost lands on.
The host's pace drifts (on the H100 machine one block of eager steps can take twice as long as
the next), so the eager steps are timed in short blocks, the modes one after another in each
round with the order rotated from round to round; reported are the median over rounds and the
median (with quartiles) of each round's ratio to ``off``, which compares blocks run
milliseconds apart.  CUDA-graph replays (GPU time per step) are timed too, for
``off`` and ``async`` (a captured call never waits; ``sync`` captures as ``async``).  Writes a
JSON file (``--out``) and prints a table.

    TORCHINDUCTOR_COMPILE_THREADS=1 PYTHONPATH=. python tests/gpu/decode_check_timing.py \
        --out decode_check_timing_h100.json            # ~2 minutes on an H100
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import flashtile  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
H, HK, D, L, PAGE = 32, 8, 128, 16384, 64
MODES = ("off", "async", "sync")


def make_step(batch: int, paged: bool, append: bool):
    """A decode step on fixed tensors: every call attends to the same ``L - 1`` keys (the
    append rewrites the same slot), so steps are identical and independent of their count."""
    g = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=DEV, dtype=DT, generator=g)  # noqa: E731
    q = r(batch, 1, H, D)
    k, v = (r(batch, 1, HK, D), r(batch, 1, HK, D)) if append else (None, None)
    if paged:
        n = batch * (L // PAGE)
        kc, vc = r(n, PAGE, HK, D), r(n, PAGE, HK, D)
        table = torch.randperm(n, device=DEV, generator=g).to(torch.int32).reshape(batch, L // PAGE)
    else:
        kc, vc, table = r(batch, L, HK, D), r(batch, L, HK, D), None
    lens = torch.full((batch,), L - 1, dtype=torch.int32, device=DEV)

    def step():
        return flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                 block_table=table, causal=True)
    return step


def set_mode(mode: str) -> None:
    os.environ["FLASHTILE_KVCACHE_CHECK"] = mode


def eager_us(step, steps: int) -> float:
    """Mean time per step of ``steps`` back-to-back eager calls, from an idle GPU to an idle
    GPU."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e6


def eager_gpu_us(step, steps: int) -> float:
    """GPU time per eager step, host excluded: a sleep kernel holds the GPU while the host
    queues ``steps`` calls, then events time the GPU running them back to back."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))  # ~0.2 s, longer than the host needs to queue the steps
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps * 1e3


def graph_us(graph, steps: int) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps * 1e3


def capture(step):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="decode_check_timing.json")
    parser.add_argument("--rounds", type=int, default=61, help="rounds of eager blocks")
    parser.add_argument("--steps", type=int, default=100, help="eager steps per block")
    parser.add_argument("--gpu-rounds", type=int, default=11, help="rounds of GPU-time blocks")
    args = parser.parse_args()
    configs = [(b, paged, append) for b in (1, 8) for paged in (False, True) for append in (True, False)]
    rows = []
    print(f"{'config':<28} {'mode':<6} {'eager us/step':>14} {'vs off':>7} {'eager GPU us':>14} "
          f"{'vs off':>7} {'graph us/step':>14} {'vs off':>7}")
    for batch, paged, append in configs:
        step = make_step(batch, paged, append)
        graphs = {}
        for mode in MODES:
            set_mode(mode)
            for _ in range(20):  # compile, record the launch plan
                step()
            if mode != "sync":
                graphs[mode] = capture(step)
        flashtile.check_kvcache_errors()
        eager = {m: [] for m in MODES}
        eager_gpu = {m: [] for m in MODES if m != "sync"}  # sync waits: no queue to hold
        graph = {m: [] for m in graphs}
        for r in range(args.rounds):
            for mode in MODES[r % 3:] + MODES[:r % 3]:
                set_mode(mode)
                eager[mode].append(eager_us(step, args.steps))
        for _ in range(args.gpu_rounds):
            for mode in MODES:
                set_mode(mode)
                if mode in eager_gpu:
                    eager_gpu[mode].append(eager_gpu_us(step, 200))
                if mode in graphs:
                    graph[mode].append(graph_us(graphs[mode], 300))
        flashtile.check_kvcache_errors()  # the steps were valid: nothing may be reported
        name = f"B{batch} L{L} {'paged' if paged else 'contig'} {'append' if append else 'attend'}"
        eg_off = statistics.median(eager_gpu["off"])
        g_off = statistics.median(graph["off"])
        for mode in MODES:
            e = statistics.median(eager[mode])
            ratios = [x / y for x, y in zip(eager[mode], eager["off"])]
            q1, ratio, q3 = statistics.quantiles(ratios, n=4)
            eg = statistics.median(eager_gpu[mode]) if mode in eager_gpu else None
            g = statistics.median(graph[mode]) if mode in graph else None
            rows.append(dict(batch=batch, seqlen=L, paged=paged, page_size=PAGE if paged else None,
                             append=append, mode=mode, eager_us=e, eager_vs_off=ratio,
                             eager_vs_off_iqr=[q1, q3], eager_rounds=eager[mode], eager_gpu_us=eg,
                             eager_gpu_vs_off=(eg / eg_off) if eg is not None else None,
                             eager_gpu_rounds=eager_gpu.get(mode), graph_us=g,
                             graph_vs_off=(g / g_off) if g is not None else None,
                             graph_rounds=graph.get(mode)))
            egtxt = f"{eg:14.1f} {eg / eg_off:7.3f}" if eg is not None else f"{'-':>14} {'-':>7}"
            gtxt = f"{g:14.1f} {g / g_off:7.3f}" if g is not None else f"{'-':>14} {'-':>7}"
            print(f"{name:<28} {mode:<6} {e:14.1f} {ratio:7.3f} {egtxt} {gtxt}")
        del graphs
    set_mode("async")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, heads=H, kv_heads=HK, head_dim=D,
                dtype=str(DT), rounds=args.rounds, steps=args.steps, gpu_rounds=args.gpu_rounds,
                method="eager: blocks of back-to-back steps between two device "
                       "synchronisations, mean per step, the modes one after another in each "
                       "round (order rotated); eager_vs_off: median over rounds of the round's "
                       "ratio (quartiles in eager_vs_off_iqr); eager GPU: 200 steps queued while "
                       "a sleep kernel holds the GPU, timed by events (host excluded); graph: "
                       "300 replays between two events; medians over rounds")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
