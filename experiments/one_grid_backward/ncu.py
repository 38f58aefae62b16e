import math, sys, torch
from flashtile.backends.triton import launch_bwd, forward
from flashtile.backends.triton.configs import KernelConfig, override
from flashtile.backends.spec import AttnSpec
B, N, H, D = 64, 1024, 16, 64
q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for causal in (False, True):
    spec = AttnSpec(1 / math.sqrt(D), -1, 0 if causal else -1)
    out, lse = forward(q, k, v, spec)
    torch.cuda.synchronize()
    with launch_bwd.two_grids():
        launch_bwd._backward(do, q, k, v, out, lse, spec)
    with override(bwd=KernelConfig(*[int(x) for x in sys.argv[1].split(",")])):
        launch_bwd._backward(do, q, k, v, out, lse, spec)
    torch.cuda.synchronize()
