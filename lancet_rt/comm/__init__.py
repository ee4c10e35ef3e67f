"""Communication: process groups (TorchGroup), the emulated link, the group monitor and fault records."""
