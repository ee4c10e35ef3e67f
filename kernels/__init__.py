"""Pure tensor kernels for lancet-rt: Triton launchers and their plain PyTorch references.

Nothing here knows about autograd, ranks or streams. Every Triton launcher has the same
signature and semantics as its reference in :mod:`lancet_rt.kernels.reference`.
"""
