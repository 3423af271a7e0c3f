"""Stand-ins for the engine probe's child (engines.engine_probe.CHILD_COMMAND) that end the way
a broken llama.cpp build does."""

from __future__ import annotations

import sys

# Killed by SIGSEGV, with faulthandler's report on stderr, as a crashing llama.cpp load is.
SEGFAULTING_CHILD = (
    sys.executable,
    "-c",
    "import faulthandler, os, signal; faulthandler.enable(); os.kill(os.getpid(), signal.SIGSEGV)",
)
# What a build carrying its own C++ runtime does (engines.cxx_runtime): dies, unless the
# system's runtime is preloaded; then the real probe runs.
CRASHING_UNLESS_PRELOADED = (
    sys.executable,
    "-c",
    "import os, signal, sys\n"
    "if 'libstdc++' not in os.environ.get('LD_PRELOAD', ''):\n"
    "    os.kill(os.getpid(), signal.SIGSEGV)\n"
    "from engines.engine_probe import main\n"
    "sys.exit(main())",
)
