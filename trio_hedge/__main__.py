"""``python -m trio_hedge``: the same as the ``trio-hedge`` command."""

import sys

from .cli import main

sys.exit(main())
