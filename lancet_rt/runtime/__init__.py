"""A step's runtime state, below every layer and driver: the chunk scope, the deferred-dW queue, casts, recompute."""
