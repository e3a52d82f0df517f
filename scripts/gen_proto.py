"""Regenerate the gRPC Python modules from src/epserve/rpc/proto/engine.proto (needs grpcio-tools).

The generated modules are committed; tests/serve/test_grpc_engine.py checks they match the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent / "src"
PROTO = "epserve/rpc/proto/engine.proto"


def generate(out_dir: Path = ROOT) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
