"""The OpenAI-compatible HTTP API: the server over the batch scheduler, and the client."""
