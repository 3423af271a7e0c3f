"""``meshnode`` whose engine probe's child dies of SIGSEGV: fault injection for tests only.

    python tests/ops/crashing_probe_meshnode.py create --model M ...

Everything else is the real command; only the probe's child is replaced, so the node must
refuse to start exactly as it would on a machine where llama.cpp crashes.
"""

import sys

from engines import engine_probe
from meshnode.app.cli import main

engine_probe.CHILD_COMMAND = (
    sys.executable,
    "-c",
    "import faulthandler, os, signal; faulthandler.enable(); os.kill(os.getpid(), signal.SIGSEGV)",
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
