"""The OpenAI-compatible HTTP gateway: an ASGI edge over the planner's gRPC client API."""
