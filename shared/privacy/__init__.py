"""Transport-layer privacy hooks: sample-level DP-SGD (``dp``)."""
