"""`python -m deltaserve`: the same as the `deltaserve` command."""

import sys

from deltaserve.cli import main

sys.exit(main())
