import itertools, json, sys, torch, torch.nn.functional as F
from engines.batched import paged_kernels as pk
def t(fn, r=20):
    for _ in range(2): fn()
    ts=[]
    for _ in range(r):
        a,b=torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True); a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]
shapes=[(6144,4096),(4096,4096),(28672,4096),(4096,14336),(128256,4096)]
W={s: torch.randn(*s,device='cuda',dtype=torch.bfloat16)/64 for s in shapes}
X={(m,k): torch.randn(m,k,device='cuda',dtype=torch.bfloat16) for m in (1,64,256) for k in (4096,14336)}
res={}
for s in shapes:
    n,k=s
    res[str(s)]={'cublas':[round(t(lambda: F.linear(X[(m,k)],W[s])),4) for m in (1,64,256)]}
cfgs=[c for c in itertools.product((16,32,64),(32,64,128),(64,128,256),(4,8),(3,4))]
for c in cfgs:
    for s in shapes:
        n,k=s
        try:
            res[str(s)][str(c)]=[round(t(lambda: pk.rows_mm(X[(m,k)],W[s],config=c)),4) for m in (1,64,256)]
        except Exception as e:
            res[str(s)][str(c)]=str(e)[:80]
json.dump(res, open(sys.argv[1],'w'))
for s in shapes:
    r=res[str(s)]
    ok={c:v for c,v in r.items() if isinstance(v,list) and c!='cublas'}
    best=sorted(ok.items(), key=lambda kv: kv[1][1]+kv[1][2]+0.5*kv[1][0])[:5]
    print(s, 'cublas', r['cublas'], 'det-tiles-256', 4*r['cublas'][1])
    for c,v in best: print('   ', c, v)
