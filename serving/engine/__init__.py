"""Device engine: the model runner (bucketed, compiled steps over the paged KV cache), the engine step and the
public `LLM` API."""
