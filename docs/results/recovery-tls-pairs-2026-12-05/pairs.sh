#!/usr/bin/env bash
# Issue 20: what auth and TLS cost `holdfast bench recovery` (death to first token through the warm standby), in
# interleaved pairs on one machine: each round runs the secured stack and the plain one (--no-secure), the order
# turning every round, nothing else running. Usage: pairs.sh ROUNDS TRIALS OUT_DIR
set -euo pipefail
rounds=${1:-4}; trials=${2:-8}; out=${3:-.}
mkdir -p "$out"; wdir=$(mktemp -d /tmp/hf-rw-XXXXXX)
for r in $(seq 1 "$rounds"); do
  if (( r % 2 )); then order="secure plain"; else order="plain secure"; fi
  for mode in $order; do
    flag=""; [[ $mode == plain ]] && flag="--no-secure"
    .venv/bin/holdfast bench recovery --backend host --ways standby --trials "$trials" --json --weights-dir "$wdir" \
      $flag > "$out/round$r-$mode.json" 2> "$out/round$r-$mode.err" || echo "round $r $mode failed: $?"
    echo "round $r $mode: $(python3 -c "import json,sys; d=json.load(open('$out/round$r-$mode.json')); print(d['warm_standby']['death_to_first_token_ms'])")"
  done
done
rm -rf "$wdir"
