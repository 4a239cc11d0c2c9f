"""``python -m kvtier.bench``: the same as ``kvtier bench``."""

import sys

from kvtier.bench.run import main

sys.exit(main(sys.argv[1:]))
