"""The quick commands stay quick: reading the command line loads no QUIC stack, HTTP library,
llama.cpp, node, head or relay server. It used to load them all (1.2 s of imports before
`meshnode status` could answer, and before every relay started); each command now loads what
it runs when it runs."""

from __future__ import annotations

import json
import subprocess
import sys

# What only running a node, the API, a relay or an engine needs.
HEAVY_MODULES = (
    "numpy",
    "gguf",
    "aiohttp",
    "aioquic",
    "llama_cpp",
    "meshnode.node.runtime",
    "meshnode.head.driver",
    "meshnode.app.head_service",
    "meshnode.app.node_serving",
    "relay.server",
)

_CHILD = """
import json, sys
from meshnode.app.cli import build_parser

parser = build_parser()
for argv in (["status", "--json"], ["invite", "--list"], ["start", "--model", "m.gguf"],
             ["relay", "--mesh", "7vgqsujcmzdyp25m4az25t4eei"], ["generate", "--prompt", "hi"], ["serve", "--model", "m.gguf"]):
    parser.parse_args(argv)
print(json.dumps([name for name in sys.argv[1:] if name in sys.modules]))
"""


def test_reading_the_command_line_loads_none_of_what_running_a_node_needs() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *HEAVY_MODULES],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
