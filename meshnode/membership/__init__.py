"""Mesh membership: keys, invites, member certificates and proofs (``credentials``,
pure) and what a member keeps on disk (``store``)."""
