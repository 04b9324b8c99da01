"""A dict-like view of a checkpoint that reads each tensor only when it is asked for.

    loaders: name -> () -> np.ndarray      (dequantise / transpose one tensor from an mmap-ed file)
    LazyParams(loaders, shapes)[name]  ->  a fresh host array, never cached

`build_model` walks the names once, so each tensor is read, cast to the model dtype, placed on its device and its
host buffer dropped before the next one is read: the host never holds a float32 copy of the whole model next to
the converted one. Shapes come from file metadata, so checking a checkpoint against its config reads no data.
Assigning a name stores that value instead (checkpoints/convert.py casts in place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np


class LazyParams(MutableMapping):
    """Canonical name -> host array, loaded on every access (see the module docstring)."""

    def __init__(
        self,
        loaders: Mapping[str, Callable[[], np.ndarray]],
        shapes: Mapping[str, tuple[int, ...]],
        progress: Callable[[int, int, str], None] | None = None,
    ):
        if set(loaders) != set(shapes):
            raise ValueError("LazyParams: loaders and shapes name different tensors")
        self._loaders = dict(loaders)
        self._shapes = {k: tuple(int(d) for d in s) for k, s in shapes.items()}
        self._stored: dict[str, Any] = {}
        self._progress = progress
        self.reads = 0  # Tensors read from the file so far (tests check each is read once).

    def __getitem__(self, name: str) -> Any:
        if name in self._stored:
            return self._stored[name]
        value = self._loaders[name]()
        self.reads += 1
        if tuple(value.shape) != self._shapes[name]:
            raise ValueError(f"{name}: read shape {tuple(value.shape)} != recorded {self._shapes[name]}")
        if self._progress is not None:
            self._progress(min(self.reads, len(self._loaders)), len(self._loaders), name)
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        self._stored[name] = value
        self._shapes[name] = tuple(value.shape)

    def __delitem__(self, name: str) -> None:
        if name not in self._shapes:
            raise KeyError(name)
        self._stored.pop(name, None)
        self._loaders.pop(name, None)
        del self._shapes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape without reading it."""
        return self._shapes[name]


def shape_of(params: Mapping[str, Any], name: str) -> tuple[int, ...]:
    """A parameter's shape, without reading it when `params` is lazy."""
    return params.shape(name) if isinstance(params, LazyParams) else tuple(params[name].shape)
