"""The phase names every method has. A round runs a method's phases in order; ``train``
and ``evaluate`` are handled by the daemons' generic loops, any other phase a method
declares is its own (its edge half builds the upload, its aggregator takes it).

Kept apart from ``base`` and ``aggregators`` so that both, and the daemons, can name the
phases without importing each other."""

TRAIN = "train"
EVALUATE = "evaluate"
