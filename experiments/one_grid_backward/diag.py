"""One grid vs two grids: where the time goes (d=128/64, N=8K, bf16)."""
import contextlib, math, sys, torch, triton
from triton.testing import do_bench
import flashtile
from flashtile.backends.triton import launch_bwd
from flashtile.backends.triton.configs import KernelConfig, override
from flashtile.backends.triton.kernels.bwd import attn_bwd_kernel
from flashtile.backends.spec import AttnSpec

real_launch = launch_bwd.launch
state = {}
def patched(kernel, grid, **kw):
    if state.get("delta") is not None and kw.get("ROLES") == 3:
        kw["DELTA"] = state["delta"]
    if state.get("only_kv") and kw.get("ROLES") == 1:
        return None
    if state.get("kv_recompute") and kw.get("ROLES") == 2:
        kw["DELTA"] = None
    r = real_launch(kernel, grid, **kw)
    if r is not None:
        c = r[0]
        state.setdefault("regs", {})[(kw["ROLES"], kw.get("DELTA") is None)] = (c.n_regs, c.n_spills, c.metadata.shared)
    return r
launch_bwd.launch = patched

def flops(B,N,H,D,causal): return 4*B*H*N*N*D*(0.5 if causal else 1)*2.5
for D in (128, 64):
  for causal in (False, True):
    B, N, H = 2, 8192, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(0)
    q,k,v,do = (torch.randn(B,N,H,D,device="cuda",dtype=torch.bfloat16,generator=g) for _ in range(4))
    spec = AttnSpec(1/math.sqrt(D), -1, 0 if causal else -1)
    from flashtile.backends.triton import forward, backward
    out, lse = forward(q,k,v,spec)
    delta = (out.float()*do.float()).sum(-1).transpose(1,2).contiguous()
    def t(ctx=contextlib.nullcontext(), **st):
        state.clear(); state.update(st)
        with ctx:
            fn = lambda: launch_bwd._backward(do,q,k,v,out,lse,spec)
            fn(); torch.cuda.synchronize()
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        return ms, dict(state.get("regs", {}))
    f = flops(B,N,H,D,causal)
    rows = {
      "two grids": t(launch_bwd.two_grids()),
      "two grids, dkdv recomputes delta": t(launch_bwd.two_grids(), kv_recompute=True),
      "one grid tuned": t(),
      "one grid, delta read (diag)": t(delta=delta),
    }
    for w in (4, 8):
        cfg = KernelConfig(128, 64, w, 2, 64, 128) if w == 8 else KernelConfig(64, 64, 4, 2, 64, 64)
        rows[f"one grid {cfg}"] = t(override(bwd=cfg))
        rows[f"one grid {cfg} delta read"] = t(override(bwd=cfg), delta=delta)
    for name, (ms, regs) in rows.items():
        print(f"d={D} causal={int(causal)} {name:60s} {ms:7.3f} ms {f/ms/1e9:6.1f} TFLOP/s regs/spills/smem {regs}")
    sys.stdout.flush()
