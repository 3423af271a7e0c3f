"""Mesh membership and its authority.

``credentials`` (pure): the mesh key, invites, expiring member certificates and
the proofs a peer shows; ``revocation`` (pure): admin-signed removals of members
and invites, and the list every node and relay keeps; ``store``: what a member
keeps on disk; ``invite_ledger``: the invites an admin issued.

Trust model: only admins (the mesh's creator and the nodes an admin promotes)
hold the mesh key, and every credential the mesh accepts is signed by it. A plain
member holds an expiring certificate that admins renew while it is online and
not removed; it cannot invite, admit, renew or remove, because nothing it could
sign verifies. A removal is a signed revocation that gossips, persists on every
node and relay, and is permanent. The README's "Trust model" section says this
for users; :mod:`.credentials` has the details.
"""
