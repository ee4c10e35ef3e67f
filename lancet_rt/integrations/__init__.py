"""Integrations beside the core: Hugging Face transformers (hf.from_hf)."""
