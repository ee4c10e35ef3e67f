"""``python -m bench.kernels``: :func:`bench.kernels.run.main`."""

import sys

from bench.kernels.run import main

if __name__ == "__main__":
    sys.exit(main())
