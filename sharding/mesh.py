"""Device meshes: a frozen ParallelConfig (sharding/config.py) names the degree of each kind of parallelism;
`make_mesh` lays the devices out as a 4-axis `jax.sharding.Mesh` (data, pipeline, expert, tensor).

Every mesh has all four axes, size 1 where unused, so the rules table in sharding/rules.py can always name them.
"tensor" is last because jax.make_mesh gives the trailing axis the devices closest together (NVLink / ICI
neighbours), and tensor parallelism all-reduces every layer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from sharding.config import ParallelConfig as ParallelConfig  # re-exported: the dataclass lives JAX-free

DATA, PIPELINE, EXPERT, TENSOR = "data", "pipeline", "expert", "tensor"
MESH_AXES = (DATA, PIPELINE, EXPERT, TENSOR)


def make_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the mesh for `parallel` with Auto axes (GSPMD propagates shardings; no explicit-sharding types).

    Args:
        parallel: degrees of parallelism.
        devices: devices to use; default all of jax.devices(), whose count must equal parallel.num_devices.

    Returns:
        A Mesh with axis names MESH_AXES.

    Raises:
        ValueError: the device count does not match the parallel degrees.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != parallel.num_devices:
        raise ValueError(
            f"{parallel} needs {parallel.num_devices} devices; {len(devices)} given "
            f"(pass devices=jax.devices()[:{parallel.num_devices}] to use a subset)"
        )
    return jax.make_mesh(parallel.axis_sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto_detect: bool = False,
) -> bool:
    """Joins a multi-host job via jax.distributed.initialize; a no-op for a single process.

    Call before any other JAX call. Multi-host is signalled by `num_processes > 1`, a coordinator address (argument
    or JAX_COORDINATOR_ADDRESS), or `auto_detect=True` (let JAX read SLURM / Open MPI / cloud TPU environments).

    Args:
        coordinator_address: "host:port" of process 0.
        num_processes: total number of processes.
        process_id: this process's rank.
        auto_detect: initialize even with no arguments, relying on JAX's cluster detection.

    Returns:
        True when jax.distributed was initialized (now or before), False for a single process.
    """
    if jax.distributed.is_initialized():
        return True
    if num_processes == 1:
        return False
    wanted = (
        auto_detect
        or (num_processes or 0) > 1
        or coordinator_address is not None
        or "JAX_COORDINATOR_ADDRESS" in os.environ
    )
    if not wanted:
        return False
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    return True
