import sys

from relay.cli import main

sys.exit(main())
