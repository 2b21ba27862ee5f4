#!/usr/bin/env bash
# run1.sh <dir> <label> [extra args]: one burst of 8,000 at 1000 x 8 from <dir>, under the shared bench lock
dir=$1; label=$2; shift 2
out=/tmp/s25/out
flock /tmp/hf-bench.lock bash -c "echo load=\$(cut -d' ' -f1 /proc/loadavg) > $out/$label.load; cd $dir && timeout 600 /work/main/.venv/bin/python -m holdfast.main bench controlplane --nodes 1000 --gpus-per-node 8 --incidents 8000 --json $* > $out/$label.json 2> $out/$label.err"
rc=$?
python3 - "$label" "$rc" <<'PY'
import json,sys
label,rc=sys.argv[1:]
load=open(f'/tmp/s25/out/{label}.load').read().strip()
try:
    d=json.load(open(f'/tmp/s25/out/{label}.json'))
    c=d['cpu_s']; n=d['resolved']
    per={k.split(' ')[0]:round(v,2) for k,v in c.items()}
    print(f"{label} {load} rc={rc} res={n} inc/s={d['incidents_per_s']} cpu_ms={d['cpu_ms_per_incident']} txn={d.get('etcd_transactions')} {per}", flush=True)
except Exception as e:
    print(label, load, rc, 'failed', e, flush=True)
PY
