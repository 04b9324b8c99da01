"""Backend selection shared by every Pallas kernel module.

A kernel entry point takes `backend: str | None` and calls `resolve_backend(backend, "<kernel>")` once,
outside any traced code, to get one of:

    "mosaic_gpu"  a Hopper-class kernel written against jax.experimental.pallas.mosaic_gpu (wgmma, TMA)
    "triton"      the Triton-lowered `pl.pallas_call`, any recent NVIDIA GPU
    "interpret"   the same `pl.pallas_call` run through the Pallas interpreter (CPU tests)
    "xla"         the module's plain-jnp `reference()`

`None` means "fastest available here": on Hopper the measured winner for that kernel (`HOPPER_CHOICE`),
on other NVIDIA GPUs "triton", and on CPU (or any other platform) "xla", because the interpreter is a
correctness tool and far too slow to serve with.
"""

from __future__ import annotations

import functools

import jax

BACKENDS = ("mosaic_gpu", "triton", "interpret", "xla")

# Measured on an H200 (benchmarks/kernels_*.py); kernels not listed fall back to "triton" on Hopper.
# A kernel only appears here once its Mosaic GPU path beat the Triton one in the same benchmark run.
HOPPER_CHOICE: dict[str, str] = {
    # H200, benchmarks/results/flash_*.json: bf16 D=128 forward 571-622 TFLOP/s vs Triton 372-446. Calls the
    # Hopper kernel cannot take (fp32, segments, windows, soft caps, traced q_offset) run the Triton kernel.
    "flash_attention": "mosaic_gpu",
}


@functools.cache
def _device_info() -> tuple[str, tuple[int, int] | None]:
    """Returns (platform, (major, minor) CUDA compute capability or None) of the default device."""
    device = jax.devices()[0]
    platform = device.platform
    if platform != "gpu":
        return platform, None
    capability = getattr(device, "compute_capability", None)
    if capability is None:  # ROCm devices have no compute capability; treat as non-NVIDIA.
        return "rocm", None
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return "gpu", (major, minor)


def device_supports(backend: str) -> bool:
    """Whether the default device can run `backend` at all (not whether it is fast)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} or None")
    platform, capability = _device_info()
    if backend in ("interpret", "xla"):
        return True
    if platform != "gpu" or capability is None:
        return False
    if backend == "triton":
        return capability >= (8, 0)  # Triton Pallas relies on Ampere-era tensor-core ops.
    return capability >= (9, 0)  # Mosaic GPU emits wgmma/TMA: Hopper (sm_90a) and newer.


def default_backend(kernel_name: str) -> str:
    """The fastest backend for `kernel_name` on the default device."""
    platform, capability = _device_info()
    if platform != "gpu" or capability is None:
        return "xla"
    if capability >= (9, 0):
        return HOPPER_CHOICE.get(kernel_name, "triton")
    if capability >= (8, 0):
        return "triton"
    return "xla"


def resolve_backend(backend: str | None, kernel_name: str) -> str:
    """Turns a user's backend request into a concrete backend name.

    Args:
        backend: None (fastest available on the default device) or one of `BACKENDS`.
        kernel_name: module-level kernel name, e.g. "flash_attention" or "paged_attention"; used to look up
            the measured Hopper choice and to make error messages specific.

    Returns:
        One of "mosaic_gpu", "triton", "interpret", "xla".

    Raises:
        ValueError: `backend` is not a known name, or the default device cannot run it.
    """
    if backend is None:
        return default_backend(kernel_name)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{kernel_name}: unknown backend {backend!r}; expected one of {BACKENDS} or None")
    if not device_supports(backend):
        platform, capability = _device_info()
        where = platform if capability is None else f"{platform} sm_{capability[0]}{capability[1]}"
        raise ValueError(f"{kernel_name}: backend {backend!r} cannot run on the default device ({where})")
    return backend


def out_struct(shape, dtype, inputs) -> jax.ShapeDtypeStruct:
    """The type of a kernel output that varies over every manual mesh axis any of `inputs` varies over.

    Inside `jax.shard_map(..., check_vma=True)` (the default) a pallas_call must say how its outputs vary across the
    mesh; outside shard_map nothing varies and this is a plain ShapeDtypeStruct. This is what lets a kernel run
    per device on its own KV heads (tests/test_sharding.py).
    """
    mats = [jax.typeof(x).mat for x in inputs]
    varying = frozenset().union(*(m.varying for m in mats))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))
