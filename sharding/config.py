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
        microbatches: pipeline microbatches a step's batch is cut into (model/pipeline.py); 0: one per stage.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    microbatches: int = 0

    def __post_init__(self):
        for field in ("dp", "tp", "pp", "ep", "microbatches"):
            value, least = getattr(self, field), 0 if field == "microbatches" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"ParallelConfig.{field} must be >= {least} (an integer), got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp * self.ep

    @property
    def axis_sizes(self) -> tuple[int, int, int, int]:
        """Sizes in sharding.mesh.MESH_AXES order (data, pipeline, expert, tensor)."""
        return (self.dp, self.pp, self.ep, self.tp)


def check_parallel(parallel: ParallelConfig, model_cfg, num_devices: int) -> None:
    """Refuses a mesh this model cannot be split over, naming the flag (serving/flags.py) that is wrong.

    Args:
        parallel: the degrees.
        model_cfg: a model.config.ModelConfig (duck-typed: num_heads, num_kv_heads, num_layers, num_experts, name).
        num_devices: devices available (jax.device_count()).

    Raises:
        ValueError: more devices than exist, heads / KV heads / layers / experts not divisible, or a degree not built
            yet.
    """
    p, name = parallel, getattr(model_cfg, "name", "the model")
    if p.num_devices > num_devices:
        raise ValueError(
            f"data_parallel_size={p.dp} x tensor_parallel_size={p.tp} x pipeline_parallel_size={p.pp} x "
            f"expert_parallel_size={p.ep} needs {p.num_devices} devices; only {num_devices} exist"
        )
    if p.pp > 1:
        check_pipeline(model_cfg, p.pp)
    heads, kv = model_cfg.num_heads, model_cfg.num_kv_heads
    if heads % p.tp:
        raise ValueError(f"tensor_parallel_size={p.tp} does not divide num_heads={heads} of {name}")
    if kv % p.tp and p.tp % kv:
        raise ValueError(
            f"tensor_parallel_size={p.tp} and num_kv_heads={kv} of {name}: one must divide the other "
            "(KV heads are split, or repeated when fewer than the devices)"
        )
    experts = getattr(model_cfg, "num_experts", 0)
    if p.ep > 1 and not experts:
        raise ValueError(f"expert_parallel_size={p.ep} needs an MoE model; {name} is dense")
    if p.ep > 1 and experts % p.ep:
        raise ValueError(f"expert_parallel_size={p.ep} does not divide num_experts={experts} of {name}")


def check_pipeline(cfg, stages: int) -> None:
    """Refuses a model whose layers cannot be split into `stages` equal pipeline stages (model/pipeline.py).

    Every stage runs the same sequence of layer kinds (window, RoPE base), so one stage program serves all.
    """
    name = getattr(cfg, "name", "the model")
    if cfg.num_layers % stages:
        raise ValueError(f"pipeline_parallel_size={stages} does not divide num_layers={cfg.num_layers} of {name}")
    n = cfg.num_layers // stages
    for i in range(cfg.num_layers):
        if (cfg.layer_window(i), cfg.layer_rope_theta(i)) != (cfg.layer_window(i % n), cfg.layer_rope_theta(i % n)):
            raise ValueError(
                f"pipeline_parallel_size={stages}: the {n}-layer stages of {name} would differ in their layer "
                "windows / RoPE bases (the pattern must repeat within a stage)"
            )
    if getattr(cfg, "num_experts", 0):
        raise ValueError(f"pipeline_parallel_size={stages} supports dense models; {name} is MoE")
