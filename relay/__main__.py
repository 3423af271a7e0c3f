"""``python -m relay``: the relay program (relay.command), without the rest of the ``meshnode`` command line."""

import sys

from relay.command import main

sys.exit(main())
