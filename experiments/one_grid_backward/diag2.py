"""One grid (counters) vs two grids: correctness, counters, speed."""
import contextlib, math, sys, torch
from triton.testing import do_bench
import flashtile
from flashtile.backends.triton import launch_bwd, forward
from flashtile.backends.triton.configs import KernelConfig, override
from flashtile.backends.spec import AttnSpec

real_launch = launch_bwd.launch
seen = {}
def patched(kernel, grid, **kw):
    r = real_launch(kernel, grid, **kw)
    if kw.get("ROLES") == 3:
        seen["cnt"], seen["grid"], seen["n_dq"] = kw["CNT"], grid, kw["GROUP"] * -(-kw["seqlen_q"] // kw["BLOCK_M"])
    return r
launch_bwd.launch = patched
mode = sys.argv[1]
ONE = KernelConfig(64, 64, 4, 2, 64, 64)

def ref_grads(q, k, v, do, causal):
    H, HK, S, D = q.shape[2], k.shape[2], q.shape[1], q.shape[3]
    qr, kr, vr = (x.double().detach().requires_grad_() for x in (q, k, v))
    kr2, vr2 = kr.repeat_interleave(H // HK, 2), vr.repeat_interleave(H // HK, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr2) / math.sqrt(D)
    if causal:
        s = s.masked_fill(torch.ones(S, k.shape[1], device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vr2)
    return torch.autograd.grad(o, (qr, kr, vr), do.double())

if mode == "check":
    torch.manual_seed(0)
    for (B, S, H, HK, D, causal) in [(2, 1000, 8, 2, 128, True), (3, 777, 4, 4, 64, False),
                                     (1, 300, 2, 1, 256, True), (64, 1024, 16, 16, 64, False)]:
        q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
        def g(ctx):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            with ctx:
                o = flashtile.flash_attn_func(*leaves, causal=causal)
                return torch.autograd.grad(o, leaves, do)
        cfg = ONE if D <= 128 else KernelConfig(64, 32, 4, 2, 64, 32)
        a = g(override(bwd=cfg)); cnt = seen["cnt"].cpu(); grid = seen["grid"]
        b = g(launch_bwd.two_grids())
        r = ref_grads(q, k, v, do, causal) if B * S * S * H < 2e9 else None
        ok_cnt = cnt[0].item() == grid[0] * grid[1] and bool((cnt[1:] == seen["n_dq"]).all())
        for n, x, y, z in zip("qkv", a, b, r if r is not None else (None,) * 3):
            e1 = (x.double() - z).abs().max().item() if z is not None else float("nan")
            e2 = (y.double() - z).abs().max().item() if z is not None else float("nan")
            print(f"B{B} S{S} H{H}/{HK} d{D} causal={int(causal)} d{n}: one-grid err {e1:.3e} two-grid err {e2:.3e} "
                  f"one-vs-two max {(x.float()-y.float()).abs().max().item():.3e} nan={x.isnan().any().item()} counters_ok={ok_cnt}")
    sys.exit(0)

def flops(B, N, H, D, causal): return 4 * B * H * N * N * D * (0.5 if causal else 1) * 2.5
shapes = [(64, 1024, 16, 64), (16, 1024, 16, 128), (2, 8192, 32, 64), (2, 8192, 16, 128)]
cfgs = [KernelConfig(64, 64, 4, s, 64, 64) for s in (1, 2, 3)] + [KernelConfig(128, 64, 4, 2, 64, 64), KernelConfig(128, 32, 4, 2, 64, 64), KernelConfig(64, 64, 4, 2, 32, 64)]
for (B, N, H, D) in shapes:
    for causal in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        spec = AttnSpec(1 / math.sqrt(D), -1, 0 if causal else -1)
        out, lse = forward(q, k, v, spec)
        def t(ctx):
            with ctx:
                fn = lambda: launch_bwd._backward(do, q, k, v, out, lse, spec)
                fn(); torch.cuda.synchronize()
                return do_bench(fn, warmup=25, rep=200, return_mode="median")
        f = flops(B, N, H, D, causal)
        two = t(launch_bwd.two_grids())
        line = [f"B{B} N{N} H{H} d{D} causal={int(causal)} two grids {f/two/1e9:6.1f}"]
        print("two", flush=True)
        for c in cfgs:
            print("cfg", c, flush=True)
            ms = t(override(bwd=c))
            torch.cuda.synchronize()
            line.append(f"{(c.block_m, c.block_n, c.num_warps, c.num_stages, c.kv_block_m, c.kv_block_n)} {f/ms/1e9:6.1f} ({two/ms:.3f}x)")
        print(" | ".join(line)); sys.stdout.flush()
