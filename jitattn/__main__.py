"""``python -m jitattn``: the ``jitattn`` command (cli.main) from a checkout without the console
script installed."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
