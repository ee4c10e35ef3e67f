"""Dispatchers: how the layer moves tokens to their experts and back."""
