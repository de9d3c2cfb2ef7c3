"""``python -m lachesis ...`` = the ``lachesis`` command."""

import sys

from lachesis.cli import main

sys.exit(main())
