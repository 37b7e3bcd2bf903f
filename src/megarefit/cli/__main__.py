"""``python -m megarefit.cli``: the same as the ``megarefit`` command."""

import sys

from megarefit.cli.main import main

sys.exit(main())
