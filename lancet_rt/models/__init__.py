"""Reference models built from lancet layers: the GPT-style attention + MoE blocks (blocks) that the main job,
the benchmarks, the tests and lancet-autotune share."""
