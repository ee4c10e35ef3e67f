"""pyproject.toml's lower bounds as pip constraints: ``make test-oldest`` installs and tests exactly them.

Every runtime and test dependency is declared ``name>=X`` (a marker allowed), or pinned ``name==X``
(the formatter, whose output is part of the tree); this prints one ``name==X`` line per dependency, so
the oldest supported set is the one the suite has run with.
``python -m tests.lower_bounds [pyproject.toml]``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

#: the extras whose dependencies the oldest run installs (the suite, and bench: its plots are drawn by
#: the GPU lane dry run)
EXTRAS = ("test", "bench")
_SPEC = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:>=|==)\s*([0-9][^,;\s]*)\s*(;.*)?$")


def lower_bounds(pyproject: Path) -> list[str]:
    """``name==X`` for every ``name>=X`` (or ``name==X``) of the project's dependencies and
    :data:`EXTRAS`, markers kept.

    Raises:
        ValueError: a dependency without a single ``>=`` lower bound (its oldest version is unknown).
    """
    project = tomllib.loads(pyproject.read_text())["project"]
    specs = list(project["dependencies"])
    for extra in EXTRAS:
        specs += project["optional-dependencies"][extra]
    pins = []
    for spec in specs:
        match = _SPEC.match(spec)
        if match is None:
            raise ValueError(
                f"{pyproject}: dependency {spec!r} needs one lower bound 'name>=X' or a pin 'name==X' "
                "(test-oldest pins it)"
            )
        name, version, marker = match.groups()
        pins.append(f"{name}=={version}" + (f" {marker.strip()}" if marker else ""))
    return pins


if __name__ == "__main__":
    print("\n".join(lower_bounds(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))))
