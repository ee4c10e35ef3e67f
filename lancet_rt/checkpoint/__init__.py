"""Checkpoints of expert-parallel models: DCP (dcp) and the Hugging Face save_pretrained layout (hf)."""
