"""``python -m lancet_rt.autotune.simulate``: the cluster simulator's command (:mod:`lancet_rt.autotune.cluster`).

Import :mod:`lancet_rt.autotune.cluster` rather than this module: importing it would rebind the package's
``simulate`` (the cost model's function) to this module.
"""

import sys

from lancet_rt.autotune.cluster import main

if __name__ == "__main__":
    main(sys.argv[1:])
