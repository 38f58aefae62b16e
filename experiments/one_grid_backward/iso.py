import math, sys, torch
from flashtile.backends.triton import launch_bwd, forward
from flashtile.backends.triton.configs import KernelConfig, override
from flashtile.backends.spec import AttnSpec
B, N, H, D = [int(x) for x in sys.argv[2].split(",")]
causal = sys.argv[3] == "1"
cfg = KernelConfig(*[int(x) for x in sys.argv[1].split(",")])
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
spec = AttnSpec(1 / math.sqrt(D), -1, 0 if causal else -1)
out, lse = forward(q, k, v, spec)
with launch_bwd.two_grids():
    ref = launch_bwd._backward(do, q, k, v, out, lse, spec)
with override(bwd=cfg):
    for _ in range(3):
        got = launch_bwd._backward(do, q, k, v, out, lse, spec)
torch.cuda.synchronize()
print(sys.argv[1:], "max diff", [(a.float() - b.float()).abs().max().item() for a, b in zip(got, ref)])
