#!/usr/bin/env bash
# run1.sh <dir> <label> [extra args]: one burst of 8,000 at 1000 x 8 from <dir>; prints a summary line
dir=$1; label=$2; shift 2
mod=holdfast.main; [ -d $dir/holdfast ] || mod=libs.cli.main
load=$(cut -d' ' -f1 /proc/loadavg)
(cd $dir && timeout 600 /work/main/.venv/bin/python -m $mod bench controlplane --nodes 1000 --gpus-per-node 8 --incidents 8000 --json "$@" > /tmp/cp/out/$label.json 2> /tmp/cp/out/$label.err)
rc=$?
python3 - "$label" "$load" "$rc" <<'PY'
import json,sys
label,load,rc=sys.argv[1:]
try:
    d=json.load(open(f'/tmp/cp/out/{label}.json'))
    c=d['cpu_s']
    b=[v for k,v in c.items() if k.startswith('bench')][0]
    print(f"{label} load={load} rc={rc} inc/s={d['incidents_per_s']} cpu_ms={d['cpu_ms_per_incident']} ctl={c['controller']} dcm={c['dc_manager0']} nats={c['nats']} etcd={c['etcd']} bench={b} txns={d['etcd_transactions']} resolved={d['resolved']}")
except Exception as e:
    print(label, load, rc, 'failed', e)
PY
