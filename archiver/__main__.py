"""``python -m archiver``: see ``archiver/cli.py``."""

import sys

from archiver.cli import main

sys.exit(main())
