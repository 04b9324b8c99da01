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


def stage_sizes(num_layers: int, stages: int) -> tuple[int, ...]:
    """Layers per pipeline stage, as even as possible (vLLM's get_pp_indices): L // p each, and the L % p extra
    layers one each to the stages before the last, from the second-to-last backwards (the last stage also runs the
    final norm and the LM head). 30 layers in 4 stages: (7, 8, 8, 7)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"pipeline_parallel_size={stages} must be in 1..num_layers={num_layers}")
    base, extra = divmod(num_layers, stages)
    sizes = [base] * stages
    for i in range(2, extra + 2):
        sizes[-i] += 1
    return tuple(sizes)


def stage_starts(num_layers: int, stages: int) -> tuple[int, ...]:
    """The first global layer of each stage."""
    sizes = stage_sizes(num_layers, stages)
    return tuple(sum(sizes[:s]) for s in range(stages))


def check_pipeline(cfg, stages: int) -> None:
    """Refuses a model whose layers cannot be split into `stages` pipeline stages (model/pipeline.py): as many
    stages as layers at most, split as evenly as possible (model/pipeline.py `stage_sizes`).

    Every stage runs the same sequence of layer kinds (window, RoPE base and scaling), so one stage program serves
    all: layer start_s + l of each stage must be of layer l's kind.
    """
    name = getattr(cfg, "name", "the model")
    if not 1 <= stages <= cfg.num_layers:
        raise ValueError(f"pipeline_parallel_size={stages} exceeds num_layers={cfg.num_layers} of {name}")
    sizes, starts = stage_sizes(cfg.num_layers, stages), stage_starts(cfg.num_layers, stages)

    def kind(i):
        return cfg.layer_window(i), cfg.layer_rope_theta(i), cfg.layer_rope_scaling(i)

    for start, size in zip(starts, sizes):
        if any(kind(start + l) != kind(l) for l in range(size)):
            raise ValueError(
                f"pipeline_parallel_size={stages}: the stages {sizes} of {name} would differ in their layer "
                "windows / RoPE bases (the pattern must repeat within a stage)"
            )
    if getattr(cfg, "num_experts", 0):
        raise ValueError(f"pipeline_parallel_size={stages} supports dense models; {name} is MoE")
