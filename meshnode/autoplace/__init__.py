"""A node that joins with no ``--model`` chooses its layer range from gossip and fetches it (issue 16).

:mod:`.mesh_models` reads what the mesh serves and claims from gossip, :mod:`.layer_costs`
prices each layer from the model's manifest, :mod:`.memory_budget` says what this machine
can hold, :mod:`meshnode.mesh.placement` decides, and :mod:`.auto_shard` runs it: claim,
fetch (:mod:`meshnode.artifacts`), serve, and move only for a large and lasting gain.
"""
