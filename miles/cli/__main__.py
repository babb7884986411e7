"""``python -m miles.cli``: the same as the ``miles`` command."""

import sys

from miles.cli import main

sys.exit(main())
