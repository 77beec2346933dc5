"""The innermost SASS loop holding a GMMA in each given .sass file: its length and opcode counts (with wgmma_e4m3_proto.py)."""
import re,collections,sys
for f in sys.argv[1:]:
    ins=[]
    for l in open(f).read().splitlines():
        m=re.match(r'\s*/\*([0-9a-f]{4})\*/\s+(.*?);',l)
        if m: ins.append((int(m.group(1),16),m.group(2).strip()))
    best=None
    for a,t in ins:
        m=re.search(r'BRA (0x[0-9a-f]+)',t)
        if m and int(m.group(1),16)<a:
            tgt=int(m.group(1),16); body=[x for b,x in ins if tgt<=b<=a]
            if any('GMMA' in x for x in body) and (best is None or len(body)<len(best)): best=body
    ops=collections.Counter(re.sub(r'^@!?U?P\w+\s+','',t).split()[0] for t in best)
    g=sum(v for k,v in ops.items() if 'GMMA' in k)
    print(f, len(best), 'GMMA', g, 'per GMMA %.1f'%(len(best)/g)); print(ops.most_common())
