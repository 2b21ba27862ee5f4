#!/usr/bin/env bash
dir=$1; label=$2; shift 2
out=/tmp/s26/out
cd $dir && timeout 600 /work/main/.venv/bin/python -m holdfast.main bench controlplane --nodes 1000 --gpus-per-node 8 --incidents 8000 --json $* > $out/$label.json 2> $out/$label.err
python3 - "$label" <<'PY'
import json,sys
label=sys.argv[1]
try:
    d=json.load(open(f'/tmp/s26/out/{label}.json'))
    print(label, d['resolved'], d['incidents_per_s'], d['cpu_ms_per_incident'], d.get('etcd_transactions'), flush=True)
except Exception as e:
    print(label, 'failed', e, flush=True)
PY
