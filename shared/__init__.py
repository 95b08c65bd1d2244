"""Code both fedattn daemons use (installed as ``fedattn_shared``)."""

PROTOCOL_VERSION = 4  # 4: windowed task downloads under a bounded deadline (TaskRequest.task_id/offset);
# 3: SecAgg receive (share check) and confirm (consistency check) steps
