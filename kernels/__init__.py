"""Pure tensor kernels for lancet-rt: Triton launchers and their plain PyTorch references.

Nothing here knows about autograd, ranks or streams. Every Triton launcher has the same
signature and semantics as its reference in :mod:`lancet_rt.kernels.reference`.

Imported under any other name than ``lancet_rt.kernels`` (the checkout's folder found first as the
top-level ``kernels``, which is Hugging Face's), it loads that package instead (``_aside.py``).
"""

if __name__ != "lancet_rt.kernels":
    import os as _os
    import runpy as _runpy

    _runpy.run_path(_os.path.join(_os.path.dirname(__file__), "_aside.py"))["step_aside"](__name__, __file__)
