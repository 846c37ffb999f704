"""The OpenAI-compatible HTTP server: request and response bodies, routes."""
