"""``python -m logitless ...``: same as the ``logitless`` console script."""

import sys

from .apps.cli import main

sys.exit(main())
