"""Reading a JSON file a user hands us (a routing trace, a step's trace, a benchmark's rows): every way
the file can be wrong is a ValueError that starts with its path and says what is wrong, never a bare
RecursionError (deep nesting) or Python's integer digit limit without the file's name."""

from __future__ import annotations

import json
import os
import sys


def read_json(path) -> object:
    """The JSON value in the file at ``path``.

    Args:
        path: a path (str, bytes or os.PathLike).

    Returns:
        The parsed value (dict, list, str, number, bool or None).

    Raises:
        ValueError: starting with the path: the file is not UTF-8, not JSON, nested too deeply for
            Python's JSON reader, or holds an integer longer than Python converts.
        OSError: the file cannot be read (its message names the path).
    """
    with open(path, "rb") as f:
        raw = f.read()
    name = os.fsdecode(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise ValueError(
            f"{name}: nested too deeply (arrays or objects more than about "
            f"{sys.getrecursionlimit()} levels deep; Python's JSON reader cannot follow it)"
        ) from None
    except ValueError as exc:  # int("9" * 5000): Python's limit on the digits of an integer
        raise ValueError(f"{name}: a number in the file is out of range ({str(exc).splitlines()[0][:200]})") from None
