"""``python -m bench.overlap``: :func:`bench.overlap.run.main`."""

from bench.overlap.run import main

if __name__ == "__main__":
    main()
