import gzip, json, sys, collections
for run in sys.argv[1:]:
    ev = json.load(gzip.open(f'{run}/profile/rl_step_7/rank0.json.gz','rt'))['traceEvents']
    X = [e for e in ev if e.get('ph')=='X' and 'dur' in e]
    ann = [e for e in X if e.get('cat')=='user_annotation' and e['name'].startswith('vlmrl.')]
    print('==', run)
    t0 = min(e['ts'] for e in X)
    for e in sorted(ann, key=lambda e: e['ts']): print(f"  {e['name']:28s} start {(e['ts']-t0)/1e3:9.1f} ms dur {e['dur']/1e3:8.1f} ms")
    gpu = [e for e in X if e.get('cat') in ('kernel','gpu_memcpy','gpu_memset')]
    fb = [e for e in ann if e['name']=='vlmrl.forward_backward'][0]
    lo, hi = fb['ts'], fb['ts']+fb['dur']
    def busy(evs):
        iv = sorted((max(e['ts'],lo), min(e['ts']+e['dur'],hi)) for e in evs if e['ts']<hi and e['ts']+e['dur']>lo)
        tot=0; end=lo
        for s,t in iv:
            if t<=end: continue
            tot += t-max(s,end); end=t
        return tot/1e3
    k = [e for e in gpu if e['cat']=='kernel']; m=[e for e in gpu if e['cat']=='gpu_memcpy']
    print(f"  in forward_backward ({fb['dur']/1e3:.0f} ms): kernels busy {busy(k):.0f} ms, memcpy busy {busy(m):.0f} ms, streams {collections.Counter(e['tid'] for e in gpu)}")
    # whole trace
    lo, hi = t0, max(e['ts']+e['dur'] for e in X)
    print(f"  whole trace {(hi-lo)/1e3:.0f} ms: kernels busy {busy(k):.0f} ms, memcpy {busy(m):.0f} ms")
    # top-level CPU events on main thread: python functions? list ray / other annotations
    names = collections.Counter()
    for e in X:
        if e.get('cat') in ('cpu_op',) : pass
    cats = collections.Counter(e.get('cat') for e in X); print('  cats', dict(cats))
