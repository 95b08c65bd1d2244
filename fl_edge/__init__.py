"""The fedattn edge daemon (``fl-edge``)."""
