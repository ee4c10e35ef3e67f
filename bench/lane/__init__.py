"""The GPU lane, ``python -m bench.lane``: its plan of steps (steps), the runner (run), the pre-flight
(preflight), the tuned kernel configurations (configs) and the files it leaves (files)."""
