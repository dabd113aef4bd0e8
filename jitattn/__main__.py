"""``python -m jitattn``: the ``jitattn`` command (cli.main) from a checkout without the console
script installed."""

import sys

from .cli import main

sys.exit(main())
