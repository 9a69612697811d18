"""Placement algorithms now live in sparkdl/layouts.py (stdlib only, beside the layouts they fill);
these names stay importable from here for code written against earlier releases."""
from sparkdl.layouts import batch_shares, link_time, place_hybrid, place_on_executors, placement_cost

__all__ = ["batch_shares", "link_time", "place_hybrid", "place_on_executors", "placement_cost"]
