"""``python -m bench.lane``: :func:`bench.lane.run.main`."""

from bench.lane.run import main

if __name__ == "__main__":
    raise SystemExit(main())
