"""``python -m meshnode`` is the ``meshnode`` command."""

import sys

from meshnode.app.cli import main

sys.exit(main())
