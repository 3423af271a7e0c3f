"""Write the golden conformance vectors to tests/vectors/.

    python scripts/generate_vectors.py          # rewrite the vectors
    python scripts/generate_vectors.py --check  # exit 1 if they drifted

A vector changes only when the schema or the canonical message changes; say so
in the commit when it does, because other implementations assert these bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshnode.wire.conformance import golden_vectors

VECTOR_DIR = Path(__file__).resolve().parent.parent / "tests" / "vectors"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if a committed vector differs")
    args = parser.parse_args(argv)
    drifted = []
    for name, data in golden_vectors().items():
        path = VECTOR_DIR / name
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                drifted.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"wrote {path.relative_to(VECTOR_DIR.parent.parent)} ({len(data)} bytes)")
    if drifted:
        print("conformance vectors drifted: " + ", ".join(drifted), file=sys.stderr)
        print("run: python scripts/generate_vectors.py", file=sys.stderr)
        return 1
    if args.check:
        print("conformance vectors are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
