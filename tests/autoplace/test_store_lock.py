"""One model store, one node: a second node pointed at a store in use is refused in one line.

Two nodes on one ``--model-store`` would each create a model's sparse file and write tensors
into whichever inode they had opened, while the journal they both append to vouched for all
of them: a node could load holes as weights. The store is now held with ``flock`` by the node
that places itself on it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.node_processes import NodeProcess
from helpers.polling import wait_until

from meshnode.artifacts.store import ArtifactStore, StoreInUse

pytestmark = pytest.mark.timeout(90)


def test_a_store_held_once_is_refused_until_released(tmp_path: Path) -> None:
    first, second = ArtifactStore(tmp_path / "store"), ArtifactStore(tmp_path / "store")
    first.lock()
    with pytest.raises(StoreInUse, match="another meshnode uses the model store"):
        second.lock()  # flock: another open of the lock file, as another process would make
    first.unlock()
    second.lock()
    second.unlock()


def test_create_on_a_model_store_another_node_uses_says_so_and_writes_no_mesh(tmp_path: Path) -> None:
    store = tmp_path / "shared-store"
    running = NodeProcess(tmp_path, "a")
    running.start("create", "--listen", "127.0.0.1:0", "--api-listen", "off", "--model-store", str(store))
    try:
        wait_until(
            lambda: running.live_status() and (store / ".lock").exists(), 30, "node A to take its store"
        )
        result = subprocess.run(
            [
                *(sys.executable, "-m", "meshnode", "create", "--data-dir", str(tmp_path / "b")),
                *("--listen", "127.0.0.1:0", "--api-listen", "off", "--model-store", str(store)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 1
        assert result.stderr.strip() == (
            f"meshnode create: another meshnode uses the model store {store}; give each node its own "
            "--model-store (the default is <data-dir>/models)"
        )
        assert not (tmp_path / "b" / "membership.json").exists()
    finally:
        running.stop()
