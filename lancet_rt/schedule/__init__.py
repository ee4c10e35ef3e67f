"""The schedule: Overlapped, cross-microbatch accumulate, the chunk scope, dW deferral, balanced chunks, recompute."""
