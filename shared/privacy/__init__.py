"""Transport-layer privacy: secure aggregation (``secagg``)."""
