"""Code both fedattn daemons use (installed as ``fedattn_shared``)."""

PROTOCOL_VERSION = 2
