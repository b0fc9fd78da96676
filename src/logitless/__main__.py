"""``python -m logitless ...``: same as the ``logitless`` console script."""

import sys

from .cli import main

sys.exit(main())
