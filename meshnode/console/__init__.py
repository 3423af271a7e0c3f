"""The mesh console: a web page any node's API serves, showing the mesh live (see :mod:`.server`)."""
