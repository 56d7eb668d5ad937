"""The inferq HTTP gateway: OpenAI-compatible endpoints in front of the Redis request
stream. Entry points: ``gateway.app.create_app`` and ``gateway.app.run``."""
