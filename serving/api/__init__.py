"""HTTP face: the OpenAI-compatible FastAPI app, its request schemas, the engine thread and the metrics."""
