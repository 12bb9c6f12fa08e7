"""Front ends beside Triton's own endpoints: an OpenAI-compatible HTTP server."""
