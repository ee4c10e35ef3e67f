"""Routing: the router (router) and the autograd Functions around the gating and permutation kernels (functions)."""

from lancet_rt.routing.router import Router, router_logits, update_expert_bias

__all__ = ["Router", "router_logits", "update_expert_bias"]
