"""``python -m kvtier.tools.kvbench``: the same as the ``kvbench`` command."""

import sys

from kvtier.tools.kvbench import main

sys.exit(main())
