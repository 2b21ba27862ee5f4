#!/usr/bin/env bash
# Build, HERE, what the GPU device machine lacks to run Holdfast's tests and benches (it has no network):
#   .whl/         Python 3.12 manylinux wheels of our dependencies that its image does not ship
#   .device/bin/  nats-server and etcd binaries
# Then call the device tool with carry [".whl", ".device"] and run scripts/device_run.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qxF '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
mkdir -p .whl .device/bin
PY=${PY:-.venv/bin/python}

# Same versions as the local virtualenv (openai and its HTTP stack: the front-door tests use the official client).
# The device image already has numpy, torch, msgpack, safetensors,
# hypothesis, pytest, pytest-timeout, typer, rich, grpcio, protobuf, zipp, cuda-bindings.
PKGS="pydantic pydantic-core pydantic-settings annotated-types typing-inspection python-dotenv nats-py aetcd
      sqlalchemy typing-extensions opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions pytest-asyncio
      fastapi starlette uvicorn uvloop httptools annotated-doc cryptography cffi pycparser pynacl msgspec
      openai jiter httpx2 httpcore2 truststore idna h11 anyio sniffio"
SPECS=""
for p in $PKGS; do
  v=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")
  SPECS="$SPECS $p==$v"
done
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $SPECS

# bench restore's peer on the same file (not a dependency of ours, not in the device image): fastsafetensors.
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d .whl fastsafetensors==0.5.0

# nkeys (NATS auth) is published as a source archive only: build its pure-Python wheel here.
$PY -m pip wheel -q --no-deps -w .whl "nkeys==$($PY -c "import importlib.metadata as m; print(m.version('nkeys'))")"

cp -f "$($PY -c 'import sys; print(sys.prefix)')/bin/nats-server" .device/bin/nats-server
if ! { (cd /tmp && apt-get download etcd-server >/dev/null 2>&1) && dpkg-deb -x /tmp/etcd-server_*.deb /tmp/etcd-x \
       && cp -f /tmp/etcd-x/usr/bin/etcd .device/bin/etcd; }; then
  cp -f "$(command -v etcd)" .device/bin/etcd  # the installed one, same package
fi
du -sh .whl .device
