"""The data directory's status socket: the server a process answers ``meshnode status`` with
(``server``), its client (``client``), and how a process that is no node answers there only
where nobody does yet (``standalone``).

Generic over what answers: a node (meshnode.node.runtime), ``meshnode serve`` and the relay
each pass their own report. It sits just above membership, whose data directory holds the
socket, below every part of a node, so the relay may import it.
"""
