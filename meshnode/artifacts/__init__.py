"""Model artifact transfer over the mesh: fetch the tensors a layer range needs from peers.

``protocol`` (the ARTIFACT stream's messages, validated), ``gguf_layout`` and ``store``
(the sparse GGUF and its journal), ``holdings`` and ``server`` (what this node uploads,
rate-limited), ``schedule`` and ``fetcher`` (several sources, verification, quarantine),
``progress`` (bar, log line, status dict), ``ranges`` (which tensors a layer range needs).
"""
