"""``python -m xpyd_deploy launch up 1p1d``: the ``xpyd`` command without its console script."""

import sys

from xpyd_deploy.cli import main

sys.exit(main())
