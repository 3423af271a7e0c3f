"""What more than one test directory uses, importable as ``helpers`` from every test.

pyproject.toml puts ``tests/`` on ``sys.path``, so ``from helpers.polling import eventually``
works the same in a test package (``tests/dataplane``) and in a plain directory
(``tests/mesh``); a script a test runs as a process adds ``tests/`` itself. What only one
directory uses stays there, in a module not named ``test_*`` (``tests/dataplane/harness.py``).

- ``mesh_helpers``: link recorders, fake links, raw QUIC peers, signed gossip entries for the
  transport, membership, mesh and node tests.
- ``polling``: ``eventually`` (in a coroutine) and ``wait_until`` (in plain code).
- ``mesh_nodes``: in-process mesh nodes (and a relay): configs, memberships, invites, starting and
  joining, finding the peer that serves a layer range.
- ``node_processes``: ``meshnode`` processes: ``NodeProcess`` and ``QuicCluster``.
- ``tiny_llama``: the tiny llama.cpp model's engines as the chain tests load them.
- ``loopback_mesh``: the in-process loopback mesh (and a peer recording what a shard service
  announces) that the data-plane and head tests run on.
- ``recording_engine``: the fake engine on a small model, recording every step.
- ``rss``: a process's resident memory, sampled while a test attacks it.
- ``step_results``: an engine step's sampled token and logits, asserted present.
"""
