"""Regenerate the ONNX model zoo: ``python models/build_zoo.py [--out models/onnx]``.

Exports every ``models.zoo.ZOO`` entry twice (``<name>.onnx`` and ``<name>.loss.onnx``) with
fixed seeds. The output is deterministic: rebuilding with the same torch, onnxscript and
onnx versions rewrites identical bytes. Prints one line per file written.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make the repository root importable for `models` and `mpgraph`.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.zoo import ZOO, export_zoo_model, zoo_filename  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "onnx"


def main(argv: list[str] | None = None) -> int:
    """Builds the zoo; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("names", nargs="*", metavar="NAME", help="zoo entries (default: all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in ZOO]
    if unknown:
        parser.error(f"unknown zoo entries {unknown}; valid choices: {', '.join(ZOO)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or ZOO:
        for with_loss in (False, True):
            path = args.out / zoo_filename(name, with_loss)
            export_zoo_model(name, with_loss, path)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
            print(f"wrote {path} ({path.stat().st_size:,} bytes, sha256 {digest})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
