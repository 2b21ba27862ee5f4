cd /work/main
for i in 1 2 3 4; do
  for m in secure no-secure; do
    timeout 300 .venv/bin/python -m holdfast.main bench recovery --backend host --streams 32 --late 8 --trials 3 --max-tokens 48 --$m --json > docs/results/recovery-tls-pairs-2026-12-05-s38/$m-$i.json 2>/dev/null
    echo "$m $i rc=$?"
  done
done
