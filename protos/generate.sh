#!/usr/bin/env bash
# Generates elastic_emb/_proto/ from protos/ (never edit the output by hand).
#
# grpcio-tools is pinned to 1.62.3: its code (protobuf 4.25 gencode) works
# with every protobuf runtime from 4.25 (TensorFlow 2.16) to 7.x (TF 2.21).
#   protos/generate.sh          regenerate
#   protos/generate.sh --check  fail if elastic_emb/_proto/ is out of date
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install --quiet grpcio-tools==1.62.3
mkdir -p "$tmp/out"
"$tmp/venv/bin/python" -m grpc_tools.protoc -Iprotos --python_out="$tmp/out" \
  --pyi_out="$tmp/out" --grpc_python_out="$tmp/out" protos/elastic_emb/ps/v1/ps.proto
# health.proto: messages only (elastic_emb/ps/server/health.py registers the service).
"$tmp/venv/bin/python" -m grpc_tools.protoc -Iprotos --python_out="$tmp/out" \
  --pyi_out="$tmp/out" protos/elastic_emb/ps/v1/health.proto
gen="$tmp/out/elastic_emb/ps/v1"
# Generated modules import each other by proto package; ours are flat and private.
sed -i 's/^from elastic_emb\.ps\.v1 import ps_pb2/from elastic_emb._proto import ps_pb2/' \
  "$gen/ps_pb2_grpc.py"
files=(ps_pb2.py ps_pb2.pyi ps_pb2_grpc.py health_pb2.py health_pb2.pyi)
if [ "${1:-}" = "--check" ]; then
  for f in "${files[@]}"; do
    diff -u "elastic_emb/_proto/$f" "$gen/$f" || {
      echo "elastic_emb/_proto/$f is out of date: run protos/generate.sh" >&2
      exit 1
    }
  done
  echo "elastic_emb/_proto/ matches protos/"
else
  mkdir -p elastic_emb/_proto
  for f in "${files[@]}"; do cp "$gen/$f" elastic_emb/_proto/; done
  echo '"""Generated from protos/ by protos/generate.sh; do not edit."""' >elastic_emb/_proto/__init__.py
fi
