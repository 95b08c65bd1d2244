"""Code both fedattn daemons use (installed as ``fedattn_shared``)."""

PROTOCOL_VERSION = 4  # 3: SecAgg receive (share check) and confirm (consistency check) steps;
#                       4: evaluation results carry correct/total, per-class counts only when asked
