"""How long a quick command takes to answer, against the bare interpreter in the same run.

`meshnode status` with no node running, `meshnode invite --help` and the relay's `--help` are
timed end to end as a person runs them (a fresh `python -m meshnode` each time), beside
`python -c pass` (the interpreter alone, the floor no command can go under). The figure is the
median of ``--rounds`` runs, taken alternately; the ratio is the command's over the floor.

    python bench/cli_startup.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _seconds(argv: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        nowhere = str(Path(scratch) / "no-node")
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "meshnode status (no node)": [sys.executable, "-m", "meshnode", "status", "--data-dir", nowhere],
            "meshnode invite --help": [sys.executable, "-m", "meshnode", "invite", "--help"],
            "meshnode relay --help": [sys.executable, "-m", "meshnode", "relay", "--help"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.rounds):
            for name, argv in commands.items():
                times[name].append(_seconds(argv))
    floor = statistics.median(times["python -c pass"])
    print(f"{'command':<28} {'median s':>9} {'x floor':>8}")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:<28} {median:9.3f} {median / floor:8.2f}")


if __name__ == "__main__":
    main()
