"""The drivers of a step: Overlapped, accumulate, warm-up, the early backward, chunk policies, balance."""
