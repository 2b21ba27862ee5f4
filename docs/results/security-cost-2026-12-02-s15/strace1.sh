#!/usr/bin/env bash
dir=$1; label=$2; shift 2
flock /tmp/hf-bench.lock bash -c "/tmp/s15/stracewatch.sh $label & cd $dir && /work/main/.venv/bin/python -m holdfast.main bench controlplane --nodes 1000 --gpus-per-node 8 --incidents 8000 --json $* > /tmp/s15/out/$label.json 2> /tmp/s15/out/$label.err; wait"
