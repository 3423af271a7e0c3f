"""The head: route planning, the distributed generation driver and the OpenAI-compatible API."""
