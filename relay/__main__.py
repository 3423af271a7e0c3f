"""``python -m relay``: an entry point into the application layer, like ``meshnode.__main__``."""

import sys

from meshnode.app.relay_command import main

sys.exit(main())
