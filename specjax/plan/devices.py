"""The devices a plan compiles for: a TPU slice through the TPU compiler (no TPU needed, the `libtpu`
wheel), or this machine's own (on CPU, as many simulated devices as a mesh needs)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

import jax

GIB = 1024 ** 3

# generation -> (libtpu's name, chip config, HBM GiB per device, TensorCores per chip in the slice name)
_TPU_GENERATIONS = {
    "v4": ("v4", "megacore", 32, 2),
    "v5p": ("v5", "megacore", 95, 2),
    "v5e": ("v5e", "default", 16, 1),
    "v6e": ("v6e", "default", 32, 1),
}
# chips -> the slice's chip grid, as Cloud TPU shapes them
_GRIDS_3D = {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4",
             128: "4x4x8", 256: "4x8x8", 512: "8x8x8"}
_GRIDS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
             256: "16x16"}


@dataclasses.dataclass(frozen=True)
class Devices:
  devices: tuple
  description: str
  memory_bytes: int | None  # per device; None: unknown (CPU)
  tpu: bool


def tpu_devices(topology: str) -> Devices:
  """A TPU slice by Cloud name ("v4-8": 8 TensorCores = 4 chips; "v5e-16": 16 chips) or by chip grid
  ("v4:2x2x1"), as devices of the TPU compiler (no TPU needed)."""
  match = re.fullmatch(r"(v4|v5p|v5e|v6e)(?:-(\d+)|:(\d+(?:x\d+){1,2}))", topology)
  known = ", ".join(f"{g}-N" for g in _TPU_GENERATIONS)
  if not match:
    raise ValueError(f"unknown TPU topology {topology!r}; name a slice ({known}, e.g. v4-8, "
                     "v5p-64, v5e-16) or a chip grid (e.g. v4:2x2x1, v5e:4x4)")
  generation, cores, grid = match.groups()
  libtpu_name, chip_config, hbm_gib, cores_per_chip = _TPU_GENERATIONS[generation]
  grids = _GRIDS_2D if generation in ("v5e", "v6e") else _GRIDS_3D
  if grid is None:
    chips, remainder = divmod(int(cores), cores_per_chip)
    if remainder or chips not in grids:
      sizes = ", ".join(f"{generation}-{n * cores_per_chip}" for n in grids)
      raise ValueError(f"unknown TPU topology {topology!r}; {generation} slices here: {sizes}")
    grid = grids[chips]
  if (grid.count("x") == 1) != (generation in ("v5e", "v6e")):
    raise ValueError(f"unknown TPU topology {topology!r}: {generation} chips form a "
                     f"{'2-D' if generation in ('v5e', 'v6e') else '3-D'} grid")
  if importlib.util.find_spec("libtpu") is None:
    raise RuntimeError(f"planning for the TPU topology {topology!r} needs the TPU compiler, the libtpu "
                       "wheel: pip install -e '.[tpu]' (about 700 MB; no TPU needed), or drop "
                       "--topology to plan on this machine's devices")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  # Only the compiler is used, no chip: let several plans (or a plan beside a TPU job) load libtpu at
  # once instead of failing on its lock file.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  chips = math.prod(int(n) for n in grid.split("x"))
  bounds = (1, 1, 1) if chips == 1 else (2, 2, 1)
  description = topologies.get_topology_desc(
      topology_name=f"{libtpu_name}:{grid}", platform="tpu", chip_config_name=chip_config,
      chips_per_host_bounds=bounds, num_slices=1)
  devices = tuple(description.devices)
  return Devices(devices, f"{topology} ({generation}:{grid}, {len(devices)} devices, "
                 f"{hbm_gib} GiB HBM each)", hbm_gib * GIB, True)


def local_devices() -> Devices:
  """This machine's devices; their memory where the runtime says it (GPU, TPU; not CPU)."""
  devices = tuple(jax.devices())
  stats = devices[0].memory_stats() or {}
  return Devices(devices, f"{len(devices)} {devices[0].platform} devices", stats.get("bytes_limit"),
                 False)


def simulate_cpu_devices(count: int) -> None:
  """On CPU, make `count` simulated devices for the mesh, if jax has not started its backends yet."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" in xla_flags or xla_bridge.backends_are_initialized():
    return
  os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={count}".strip()
