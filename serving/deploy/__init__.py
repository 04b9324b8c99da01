"""Replicas of the engine behind one OpenAI endpoint on Ray Serve (docs/deployment.md)."""
