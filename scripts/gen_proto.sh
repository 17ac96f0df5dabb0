#!/usr/bin/env bash
# Regenerate psctl/proto/*_pb2*.py from psctl.proto (needs grpcio-tools: pip install -e '.[dev]').
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. psctl/proto/psctl.proto
