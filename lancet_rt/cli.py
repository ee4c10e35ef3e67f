"""Argument types the commands share (``bench.*``, ``lancet-autotune``, the replay): each turns the text
of one argument into a value in its allowed range or refuses it, so argparse prints one line naming
the argument, the value and what is allowed (``error: argument --ranks: must be an int in [2, 64],
got '1'``) and exits with status 2 before the command does any work. NaN and infinities are never a
number here."""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional


def _range(lo, hi, above: bool) -> str:
    low = "" if lo is None else f"{'>' if above else '>='} {lo:g}"
    high = "" if hi is None else f"<= {hi:g}"
    if low and high and not above:
        return f"in [{lo:g}, {hi:g}]"
    return " and ".join(p for p in (low, high) if p)


def int_in(lo: Optional[int] = None, hi: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type``: an int in [``lo``, ``hi``] (either bound may be None: open).

    Returns:
        The callable argparse calls with the argument's text.
    """
    allowed = f"an int {_range(lo, hi, False)}".strip()

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def float_in(lo: Optional[float] = None, hi: Optional[float] = None, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in [``lo``, ``hi``] (``above``: strictly above ``lo``).

    Returns:
        The callable argparse calls with the argument's text.
    """
    allowed = f"a finite number {_range(lo, hi, above)}".strip()

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = (
            math.isfinite(value)
            and (lo is None or (value > lo if above else value >= lo))
            and (hi is None or value <= hi)
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


def list_of(item: Callable[[str], object], *, unique: bool = False) -> Callable[[str], list]:
    """An argparse ``type``: a comma-separated, non-empty list of ``item`` values (``unique``: no repeats).

    Returns:
        The callable argparse calls with the argument's text.
    """

    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        values = []
        for p in parts:
            try:
                values.append(item(p))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"item {p!r} of {text!r}: {exc} (a comma-separated list)") from None
        if unique and len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"must be a comma-separated list without repeats, got {text!r}")
        return values

    parse.__name__ = "list"
    return parse


def or_word(item: Callable[[str], object], *words: str, value=None) -> Callable[[str], object]:
    """An argparse ``type``: one of ``words`` (default "none"; any case), giving ``value``, or an ``item`` value.

    Returns:
        The callable argparse calls with the argument's text.
    """
    words = words or ("none",)

    def parse(text: str):
        if text.strip().lower() in words:
            return value
        try:
            return item(text)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (or {' or '.join(map(repr, words))})") from None

    parse.__name__ = getattr(item, "__name__", "value")
    return parse


def checked(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type`` from a parser that raises ValueError (its message becomes argparse's line).

    Returns:
        The callable argparse calls with the argument's text.
    """

    def parse_checked(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse_checked.__name__ = getattr(parse, "__name__", "value")
    return parse_checked
