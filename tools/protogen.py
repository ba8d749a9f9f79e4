"""Generate Python stubs for proto/*.proto into accelnode/pb (``make proto``).

Files are compiled with the virtual include path ``accelnode/pb`` so the generated modules
import each other as ``accelnode.pb.<name>_pb2``. ``check()`` regenerates into a temporary
directory and reports any difference from the committed stubs (the staleness test uses it).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PKG = "accelnode/pb"


def generate(protos: list[Path], out_root: Path) -> None:
    from grpc_tools import protoc  # dev dependency
    import grpc_tools

    wkt = Path(grpc_tools.__file__).parent / "_proto"
    for p in protos:
        args = [
            "protoc",
            f"-I{PKG}={PROTO_DIR}",
            f"-I{wkt}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            f"{PKG}/{Path(p).name}",
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {p}")


def check() -> list[str]:
    """Names of generated files that differ from, or are missing in, accelnode/pb."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as td:
        generate(protos, Path(td))
        fresh = Path(td) / PKG
        stale = []
        for f in sorted(fresh.iterdir()):
            have = ROOT / PKG / f.name
            if not have.exists() or not filecmp.cmp(f, have, shallow=False):
                stale.append(f.name)
        return stale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=PKG)
    ap.add_argument("protos", nargs="*")
    a = ap.parse_args()
    out = Path(a.out)
    out_root = Path(str(out.resolve())[: -len(PKG)]) if str(out.resolve()).endswith(PKG) else ROOT
    protos = [Path(p) for p in a.protos] or sorted(PROTO_DIR.glob("*.proto"))
    generate(protos, out_root)
    (ROOT / PKG / "__init__.py").touch()
    print(f"generated {len(protos)} proto(s) into {PKG}", file=sys.stderr)


if __name__ == "__main__":
    main()
