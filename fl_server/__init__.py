"""The fedattn server daemon (``fl-server``)."""
