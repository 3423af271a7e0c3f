"""``python -m meshnode`` is the ``meshnode`` command."""

import sys

from meshnode.cli import main

sys.exit(main())
