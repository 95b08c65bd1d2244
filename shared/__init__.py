"""Code both fedattn daemons use (installed as ``fedattn_shared``)."""

# 5: an edge may decline work ("not now": TaskRequest.decline).
# 4: windowed task downloads under a bounded deadline (TaskRequest.task_id/offset);
#    evaluation results carry correct/total, per-class counts only when asked.
# 3: SecAgg receive (share check) and confirm (consistency check) steps.
PROTOCOL_VERSION = 5
