"""``python -m lightning_prague.tools.cluster``: the emulated cluster's command line (see `emulate`)."""

import sys

from .emulate import main

sys.exit(main())
