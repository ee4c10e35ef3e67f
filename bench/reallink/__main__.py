"""``python -m bench.reallink``: :func:`bench.reallink.run.main`."""

import sys

from bench.reallink.run import main

if __name__ == "__main__":
    sys.exit(main())
