"""Chunk-count policies: what :class:`lancet_rt.Overlapped` asks for its chunk count when it is not an int.

``Overlapped(model, chunks=...)`` takes an int, a registered policy name such as ``"auto"``, a
:class:`ChunkPolicy`, or a factory ``factory(overlapped) -> ChunkPolicy``. Names resolve through a
registry that other packages fill: ``import lancet_rt.autotune`` registers its ``AutoChunks`` under
``"auto"``, so the runtime itself never imports the autotuner.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

__all__ = [
    "ChunkPolicy",
    "register_chunk_policy",
    "registered_chunk_policies",
    "check_chunks",
    "check_chunk_count",
    "resolve_chunk_policy",
    "MAX_CHUNKS",
]

#: The largest chunk count accepted (from an argument, a policy or the autotune cache). Overlap pays
#: off at a few chunks (2-8); a count in the thousands only runs the model that many times.
MAX_CHUNKS = 256


@runtime_checkable
class ChunkPolicy(Protocol):
    """Chooses the chunk count of each forward of one :class:`lancet_rt.Overlapped`."""

    def next_chunks(self, args: tuple, kwargs: dict) -> int:
        """The chunk count (>= 1) for the forward on ``(args, kwargs)``."""
        ...


ChunkPolicyFactory = Callable[[Any], ChunkPolicy]

_REGISTRY: dict[str, ChunkPolicyFactory] = {}
_HINTS = {"auto": "import lancet_rt.autotune"}  # the import that registers a well-known name


def register_chunk_policy(name: str, factory: ChunkPolicyFactory) -> None:
    """Make ``Overlapped(..., chunks=name)`` build its policy with ``factory``.

    Args:
        name: the string passed as ``chunks`` (registering a name again replaces its factory).
        factory: ``factory(overlapped)`` -> a :class:`ChunkPolicy`, called once per
            :class:`lancet_rt.Overlapped`, on its first forward.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    _REGISTRY[name] = factory


def registered_chunk_policies() -> list[str]:
    """The names ``chunks`` accepts besides ints, policies and factories.

    Returns:
        The registered names, sorted.
    """
    return sorted(_REGISTRY)


def check_chunks(chunks) -> None:
    """Raise unless ``chunks`` is an int >= 1, a registered name, a :class:`ChunkPolicy` or a factory.

    Args:
        chunks: the ``chunks`` argument of :class:`lancet_rt.Overlapped` or :func:`lancet_rt.from_hf`.
    """
    if isinstance(chunks, str):
        if chunks in _REGISTRY:
            return
        if chunks in _HINTS:
            raise ValueError(f"chunks={chunks!r} needs its policy registered: {_HINTS[chunks]} first")
    elif isinstance(chunks, int) and not isinstance(chunks, bool):
        if 1 <= chunks <= MAX_CHUNKS:
            return
        raise ValueError(f"chunks must be an int in [1, {MAX_CHUNKS}] (MAX_CHUNKS) or 'auto', got {chunks!r}")
    elif isinstance(chunks, ChunkPolicy) or callable(chunks):
        return
    raise ValueError(f"chunks must be an int >= 1 or 'auto', got {chunks!r}")


def check_chunk_count(n, source: str) -> int:
    """``n`` if it is an int in [1, :data:`MAX_CHUNKS`], else a ValueError naming ``source``.

    Args:
        n: a chunk count a policy returned.
        source: what returned it (for the message).
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHUNKS:
        raise ValueError(f"{source} returned chunks={n!r}; a chunk count must be an int in [1, {MAX_CHUNKS}]")
    return n


def resolve_chunk_policy(chunks, overlapped) -> ChunkPolicy:
    """The policy that ``chunks`` (not an int) names or builds for ``overlapped``.

    Args:
        chunks: a registered name, a :class:`ChunkPolicy`, or a factory ``factory(overlapped)``.
        overlapped: the :class:`lancet_rt.Overlapped` the policy serves.

    Returns:
        The :class:`ChunkPolicy`.
    """
    check_chunks(chunks)
    if isinstance(chunks, str):
        policy = _REGISTRY[chunks](overlapped)
    elif isinstance(chunks, ChunkPolicy):
        return chunks
    else:
        policy = chunks(overlapped)
    if not isinstance(policy, ChunkPolicy):
        raise TypeError(f"chunks: the factory returned {type(policy).__name__}, which has no next_chunks(args, kwargs)")
    return policy
