cd /work/main
for i in 1 2 3 4; do
  for v in W X; do
    if [ $v = X ]; then e=false; else e=true; fi
    HF_DISPATCH_BEFORE_CREATE=$e timeout 300 .venv/bin/python -m holdfast.main bench recovery --backend host --streams 32 --late 8 --trials 3 --max-tokens 48 --secure --json > docs/results/dispatch-first-2026-12-05/local-$v$i.json 2>/dev/null
    echo "$v$i rc=$?"
  done
done
