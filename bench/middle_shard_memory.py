"""Resident memory of a middle shard and the slice files on disk, for this tree and another.

Each shard loads in a fresh child process with the source tree on ``PYTHONPATH``, serving
4 sessions of 4096 tokens (the node's defaults), runs a 128-token prefill and 8 decodes,
and reports its process's ``VmRSS`` and ``RssFile`` (``/proc/self/status``) and the size
of its slice file. ``--baseline-tree`` is an unpacked older tree, e.g.
``git archive fe0bead | tar -x -C /tmp/before`` (copy ``engines/_hidden_capture*.so`` in).

    .venv/bin/python bench/middle_shard_memory.py --baseline-tree /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 1 << 20
HERE = Path(__file__).resolve().parent.parent

_CHILD = """
import json, os, sys
import numpy as np
from engines.interface import LoadRequest, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine

path, start, end, cache_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
engine = LlamaShardEngine()
caps = engine.load(LoadRequest(path, start, end, n_ctx=4096, n_seq_max=4, n_batch=128, n_threads=2,
                               cache_dir=cache_dir))
rng = np.random.default_rng(3)
key = SessionKey("memory", 1)
if start == 0:
    engine.prefill(StepRequest(key, 0, token_ids=tuple(range(10, 138))))
    step = lambda i: StepRequest(key, 128 + i, token_ids=(11,), expected_past_len=128 + i)
else:
    engine.prefill(StepRequest(key, 0, hidden=rng.standard_normal((128, caps.hidden_size)).astype(np.float32)))
    step = lambda i: StepRequest(key, 128 + i, hidden=rng.standard_normal((1, caps.hidden_size)).astype(np.float32),
                                 expected_past_len=128 + i)
for i in range(8):
    engine.decode(step(i))
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda name: int(status[name].split()[0]) * 1024
slice_path = str(engine._main.model_path)
print(json.dumps({"rss": kib("VmRSS"), "rss_file": kib("RssFile"), "slice_bytes": os.path.getsize(slice_path)}))
"""


def measure(tree: Path, model: Path, start: int, end: int, cache_dir: Path) -> dict[str, int]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), str(start), str(end), str(cache_dir)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{tree} [{start}, {end}) failed:\n{done.stderr[-3000:]}")
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline-tree", type=Path, help="an older tree to measure the same way")
    parser.add_argument("--ranges", default="0:6,6:12,12:18", help="the split, as start:end pairs")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from engines.default_model import default_model_path

    model = default_model_path(progress=False)
    ranges = [tuple(int(x) for x in part.split(":")) for part in args.ranges.split(",")]
    trees = [("this tree", HERE)] + ([("baseline", args.baseline_tree)] if args.baseline_tree else [])
    print(f"{model.name}, 4 sessions x 4096 tokens, after a 128-token prefill and 8 decodes")
    print(f"{'tree':10} {'range':9} {'RSS MiB':>8} {'file-backed':>12} {'slice MiB':>10}")
    for label, tree in trees:
        with tempfile.TemporaryDirectory(prefix="slices-") as cache:
            for start, end in ranges:
                got = measure(tree, model, start, end, Path(cache))
                print(
                    f"{label:10} [{start}, {end}){'':<{7 - len(f'{start}{end}')}}"
                    f" {got['rss'] / MIB:8.1f} {got['rss_file'] / MIB:12.1f} {got['slice_bytes'] / MIB:10.1f}"
                )


if __name__ == "__main__":
    main()
