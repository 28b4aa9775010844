"""``python -m autopar``: the ``autopar`` command (``autopar/tools/cli.py``)."""

import sys

from autopar.tools.cli import main

sys.exit(main())
