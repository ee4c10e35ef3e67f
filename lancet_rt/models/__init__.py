"""Reference models built from lancet layers, shared by the main job, the benchmarks, the tests and
lancet-autotune: the GPT-style attention + MoE blocks (blocks), the language model around them (lm, the
main job's: examples/train_lm.py), the blocks on packed variable-length sequences (varlen), and small
transformers MoE models built from config objects, no downloads (hf_models)."""
