"""``python -m extractor.cli``: the command line, as the ``extractor`` console script runs it."""

import sys

from . import main

sys.exit(main())
