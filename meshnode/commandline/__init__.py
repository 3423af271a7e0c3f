"""The command-line plumbing both programs share: ``meshnode`` (meshnode.app) and ``python -m relay``.

Argument types (``argument_types``), the options every command takes (``common_options``) and
the config file and environment behind them (``config``), where a command keeps its state
(``data_dirs``), the frame-buffer options (``read_limit_options``), the one-line error a command
stops with (``cli_error``) and the event loop a command runs on (``event_loop``). It sits just
above membership and the transport it reads options for, beside the status socket
(meshnode.statussocket) and below every part of a node: the relay may import it, and it imports
nothing of either program.
"""
