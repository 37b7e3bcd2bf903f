import sys

from megarefit.cli import main

sys.exit(main())
