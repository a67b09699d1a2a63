"""The OpenAI-compatible HTTP gateway: a separate process in front of the daemon."""
