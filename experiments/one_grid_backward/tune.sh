set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
python -c "import torch,triton;print(torch.__version__,triton.__version__)"
export TORCHINDUCTOR_COMPILE_THREADS=1
# correctness first (small), then the one-grid search
timeout 120 python - <<'PY'
import torch, flashtile, math
from flashtile.backends.triton.launch_bwd import two_grids
torch.manual_seed(0)
for (B,S,H,HK,D,causal) in [(2,1000,8,2,128,True),(2,777,4,4,64,False),(1,300,2,1,256,True)]:
    q=torch.randn(B,S,H,D,device="cuda",dtype=torch.bfloat16,requires_grad=True)
    k=torch.randn(B,S,HK,D,device="cuda",dtype=torch.bfloat16,requires_grad=True)
    v=torch.randn(B,S,HK,D,device="cuda",dtype=torch.bfloat16,requires_grad=True)
    do=torch.randn(B,S,H,D,device="cuda",dtype=torch.bfloat16)
    def g(ctx):
        with ctx:
            o=flashtile.flash_attn_func(q,k,v,causal=causal)
            return torch.autograd.grad(o,(q,k,v),do)
    import contextlib
    a=g(contextlib.nullcontext()); b=g(two_grids())
    qr,kr,vr=(x.double().detach().requires_grad_() for x in (q,k,v))
    kr2=kr.repeat_interleave(H//HK,2); vr2=vr.repeat_interleave(H//HK,2)
    s=torch.einsum("bqhd,bkhd->bhqk",qr,kr2)/math.sqrt(D)
    if causal: s=s.masked_fill(torch.ones(S,S,device="cuda",dtype=torch.bool).triu(1),float("-inf"))
    o=torch.einsum("bhqk,bkhd->bqhd",s.softmax(-1),vr2)
    r=torch.autograd.grad(o,(qr,kr,vr),do.double())
    for n,x,y,z in zip("qkv",a,b,r):
        print(B,S,H,HK,D,causal,n,"one-grid err",(x.double()-z).abs().max().item(),"two-grid err",(y.double()-z).abs().max().item(), "nan", x.isnan().any().item())
PY
timeout 470 python -m flashtile.backends.triton.tune --passes bwd --d 64 128 --n 8192 --jobs 15 --out $OUT/tune_bwd.json 2>&1 | grep -v "^$" | tail -120
