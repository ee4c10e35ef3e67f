"""The overlap benchmark's sizes: per device and ``--quick``, each overridable by its argument."""

from __future__ import annotations


def sizes(args) -> dict:
    cuda = args.device == "cuda"
    if args.quick:
        d = dict(
            layers=2,
            d_model=128,
            d_ffn=256,
            experts=8,
            batch=16,
            seq=64,
            heads=4,
            latency_us=20.0,
            steps=11,
            dtype="bfloat16" if cuda else "float32",
        )
    elif cuda:
        d = dict(
            layers=4,
            d_model=2048,
            d_ffn=4096,
            experts=16,
            batch=16,
            seq=1024,
            heads=16,
            latency_us=20.0,
            steps=10,
            dtype="bfloat16",
        )
    else:
        d = dict(
            layers=2,
            d_model=256,
            d_ffn=512,
            experts=8,
            batch=8,
            seq=128,
            heads=4,
            latency_us=20.0,
            steps=5,
            dtype="float32",
        )
    for k in list(d):
        v = getattr(args, k, None)
        if v is not None:
            d[k] = v
    return d
