"""``python -m bench.peers``: :func:`bench.peers.run.main`."""

from bench.peers.run import main

if __name__ == "__main__":
    main()
