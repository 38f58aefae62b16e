"""CPU engine against PyTorch's CPU SDPA and naive attention: time and peak memory.

usage: [THREADS=1|2] PYTHONPATH=. python benchmarks/bench_cpu.py   (N=4096, d=64, B=1, fp32)
"""
import os
import subprocess, sys, tempfile, time
import torch
import torch.nn.functional as F
from flashtile.backends import torch_tiled as T
from flashtile.backends.spec import AttnSpec

N, D = 4096, 64
TMP = os.path.join(tempfile.gettempdir(), "flashtile_bench_cpu")
os.makedirs(TMP, exist_ok=True)
THREADS = int(os.environ.get("THREADS", "2"))
# with one thread, CPU time of the process is the wall time minus what other tenants take
clock = time.process_time if THREADS == 1 else time.perf_counter

def inputs(H):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, N, H, D, generator=g) for _ in range(4)]  # q, k, v, do (flash layout)

def run(method, H, causal):
    """One call of `method`; returns its peak RSS growth in MiB (fresh process)."""
    q, k, v, do = inputs(H)
    spec = AttnSpec(softmax_scale=D ** -0.5, window_right=0 if causal else -1)
    if method == "tiled_bwd":
        o, lse = torch.load(os.path.join(TMP, f"ol_{H}_{int(causal)}.pt"))
    base = hwm_reset()
    if method == "naive":       # materialises (B, H, N, N) scores and probabilities
        s = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) * D ** -0.5
        if causal:
            s.masked_fill_(torch.ones(N, N, dtype=torch.bool).triu_(1), float("-inf"))
        p = torch.softmax(s, -1); del s
        out = p @ v.transpose(1, 2)
    elif method == "sdpa":
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    elif method == "tiled":
        out = T.forward(q, k, v, spec)
    elif method == "tiled_bwd":
        out = T.backward(do, q, k, v, o, lse, spec)
    return (hwm() - base) / 1024

def hwm():  # peak resident set size (VmHWM), KiB
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])

def hwm_reset():  # writing 5 to clear_refs resets VmHWM to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return hwm()

def timings(H, causal, reps=5):
    q, k, v, do = inputs(H)
    spec = AttnSpec(softmax_scale=D ** -0.5, window_right=0 if causal else -1)
    qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    o, lse = T.forward(q, k, v, spec)
    torch.save((o, lse), os.path.join(TMP, f"ol_{H}_{int(causal)}.pt"))
    def sdpa_fwd(): F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    def sdpa_bwd():
        a, b, c = (x.clone().requires_grad_() for x in (qt, kt, vt))
        out = F.scaled_dot_product_attention(a, b, c, is_causal=causal)
        t = clock(); out.backward(dot); return clock() - t
    def timed(f):
        t = clock(); r = f(); return r if isinstance(r, float) else clock() - t
    fns = {"sdpa_fwd": sdpa_fwd, "tiled_fwd": lambda: T.forward(q, k, v, spec),
           "sdpa_bwd": sdpa_bwd, "tiled_bwd": lambda: T.backward(do, q, k, v, o, lse, spec)}
    best = {n: float("inf") for n in fns}
    for f in fns.values(): f()
    for _ in range(reps):                      # interleaved, best of `reps`
        for n, f in fns.items():
            best[n] = min(best[n], timed(f))
    return best

if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(run(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")); sys.exit()
    torch.set_num_threads(THREADS)
    for H in (8, 16):
        for causal in (False, True):
            t = timings(H, causal)
            mem = {m: float(subprocess.check_output([sys.executable, __file__, m, str(H), str(int(causal))]))
                   for m in ("naive", "sdpa", "tiled", "tiled_bwd")}
            print(f"H={H:2d} causal={causal!s:5}  fwd: sdpa {t['sdpa_fwd']:.3f}s tiled {t['tiled_fwd']:.3f}s "
                  f"(x{t['tiled_fwd'] / t['sdpa_fwd']:.2f})  bwd: sdpa {t['sdpa_bwd']:.3f}s tiled {t['tiled_bwd']:.3f}s "
                  f"(x{t['tiled_bwd'] / t['sdpa_bwd']:.2f})  peak MiB: naive {mem['naive']:.0f} sdpa {mem['sdpa']:.0f} "
                  f"tiled fwd {mem['tiled']:.0f} tiled bwd {mem['tiled_bwd']:.0f}  (naive/tiled x{mem['naive'] / mem['tiled']:.0f})",
                  flush=True)
