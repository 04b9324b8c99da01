"""ParallelConfig: the degree of each kind of parallelism, as a frozen dataclass with no JAX import.

It lives apart from sharding/mesh.py so that host-side configuration (serving/config.py, the binaries' flags)
can name parallel degrees without importing JAX; `make_mesh` in sharding/mesh.py turns one into a device mesh.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism; their product is the number of devices in the mesh.

    Attributes:
        dp: data parallel (independent batch shards / engine replicas).
        tp: tensor parallel (attention heads, MLP width and vocab split across devices).
        pp: pipeline parallel (layers split into stages).
        ep: expert parallel (MoE experts split across devices).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for field in ("dp", "tp", "pp", "ep"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{field} must be >= 1 (an integer), got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp * self.ep

    @property
    def axis_sizes(self) -> tuple[int, int, int, int]:
        """Sizes in sharding.mesh.MESH_AXES order (data, pipeline, expert, tensor)."""
        return (self.dp, self.pp, self.ep, self.tp)
