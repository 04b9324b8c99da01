"""Serving, in three floors that import only downwards (tests/test_layout.py checks there is no cycle):

    serving/core/     host: requests, sampling params, KV blocks, radix cache, scheduler (pure Python, no JAX)
    serving/engine/   device: model runner, engine step, the public `LLM`
    serving/api/      HTTP: the OpenAI app, its schemas, the engine thread, metrics
    serving/generate.py, serving/server.py: thin absl binaries

`LLM` is imported lazily so that `import serving.core.scheduler` never pulls in JAX.
"""


def __getattr__(name):
    if name in ("LLM", "CompletionOutput"):
        from serving.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
