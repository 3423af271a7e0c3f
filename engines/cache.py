"""Where derived artifacts live (sliced models, manifests, digests, probe results).

They are written with :mod:`engines.atomic_files`, so a crash never leaves half of one.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "MESHNODE_CACHE_DIR"


def cache_root() -> Path:
    """``$MESHNODE_CACHE_DIR`` or ``~/.cache/meshnode``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured) if configured else Path.home() / ".cache" / "meshnode"


__all__ = ["CACHE_ENV_VAR", "cache_root"]
