"""HTTP APIs served by a node."""
