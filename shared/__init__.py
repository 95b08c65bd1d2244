"""Code both fedattn daemons use (installed as ``fedattn_shared``)."""

PROTOCOL_VERSION = 3  # 3: SecAgg receive (share check) and confirm (consistency check) steps
