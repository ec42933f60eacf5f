"""``python -m kvtier.tools.kvctl``: the same as the ``kvctl`` command."""

import sys

from kvtier.tools.kvctl import main

sys.exit(main())
