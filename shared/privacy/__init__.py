"""Transport-layer privacy: secure aggregation (``secagg``) and sample-level DP-SGD (``dp``)."""
