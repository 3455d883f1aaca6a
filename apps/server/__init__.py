"""The OpenAI-compatible HTTP server: `edgespec serve`."""
