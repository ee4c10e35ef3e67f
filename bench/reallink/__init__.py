"""A real rate-limited link between ranks on one machine (root): the link (link), its probe (probe),
the launcher's command line (run, ``python -m bench.reallink``), the acceptance runs on it (acceptance,
``python -m bench.reallink.acceptance``) and FSDP + expert parallelism over it (fsdp,
``python -m bench.reallink.fsdp``)."""
