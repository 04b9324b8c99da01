"""Serving: host-side scheduling state (pure Python) and the JAX runner/engine behind the public `LLM` API.

`LLM` is imported lazily so that `import serving.scheduler` and the other host-side modules never pull in JAX.
"""


def __getattr__(name):
    if name in ("LLM", "CompletionOutput"):
        from serving import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
