"""The application: the ``meshnode`` command line and what only a running process needs.

This is the top layer. It parses options (and their config file and
environment), wires a node, its shard service, the head and the API together
(:mod:`.head_service`, :mod:`.node_serving`), runs the process until a signal,
drains it (:mod:`.lifecycle`) and talks to a running node through its status
socket (:mod:`.status`). Nothing below it imports it; ``meshnode.__main__`` and
``relay.__main__`` are entry points into it.

Every subcommand lives in a module listed in :data:`.cli.COMMAND_MODULES`.
"""
