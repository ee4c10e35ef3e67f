"""The real peers (torchtitan, DeepSpeed-MoE) on our weights: their MoE layers (layers) and the
benchmark against them (run, ``python -m bench.peers``)."""
