"""`Layout(dp, pp, tp)`: how many ways a run cuts the data, the layers and the inside of a layer.

    layout = pl.Layout(dp=2, pp=2, tp=2)      # 8 devices
    layout.coordinates(5)                      # (1, 0, 1): replica 1, stage 0, tensor-parallel rank 1

The world's ranks are laid out as `torch.distributed.device_mesh.init_device_mesh(device,
(dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))` lays them out, row-major:

    rank = (dp_index * pp + pp_index) * tp + tp_index

so the ranks of one tensor-parallel group are consecutive — on a cluster, inside one node,
where the fast links are (Megatron-LM, Narayanan et al. 2021, §3.3: tensor parallelism
inside a node, pipeline parallelism across nodes).  Real runs: BLOOM-176B trained on
384 GPUs as dp=8, pp=12, tp=4; Megatron-LM's 1-trillion-parameter run on 3072 GPUs as
dp=6, pp=64, tp=8.
"""

from __future__ import annotations

from dataclasses import dataclass

DIMENSIONS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Layout:
    """dp data-parallel replicas, each a pipeline of pp stages, each stage split over tp ranks."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        """dp · pp · tp: the number of ranks (devices) the layout needs."""
        return self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        """(dp, pp, tp): the shape of the DeviceMesh."""
        return (self.dp, self.pp, self.tp)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp_index, pp_index, tp_index) of a global rank."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must lie in 0..{self.world_size - 1} for {self}, got {rank!r}")
        return rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp

    def rank(self, dp_index: int, pp_index: int, tp_index: int) -> int:
        """The global rank at those coordinates (the inverse of `coordinates`)."""
        for name, index, size in zip(DIMENSIONS, (dp_index, pp_index, tp_index), self.shape):
            if not 0 <= index < size:
                raise ValueError(f"{name}_index must lie in 0..{size - 1} for {self}, got {index}")
        return (dp_index * self.pp + pp_index) * self.tp + tp_index

    @classmethod
    def for_world(cls, world_size: int, data_parallel: int = 1, tensor_parallel: int = 1) -> "Layout":
        """The layout of `world_size` ranks with those dp and tp: pp = world_size / (dp · tp)."""
        probe = cls(dp=data_parallel, tp=tensor_parallel)  # checks both
        if world_size % (probe.dp * probe.tp):
            raise ValueError(f"{world_size} ranks cannot be split into data_parallel={probe.dp} × "
                             f"tensor_parallel={probe.tp} groups: dp · tp must divide the world size")
        return cls(dp=probe.dp, pp=world_size // (probe.dp * probe.tp), tp=probe.tp)

    @classmethod
    def all_for(cls, world_size: int) -> list["Layout"]:
        """Every layout with dp · pp · tp = world_size."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        divisors = _divisors(world_size)
        return [cls(dp, world_size // (dp * tp), tp) for dp in divisors for tp in divisors
                if (world_size // dp) % tp == 0]

    def __str__(self) -> str:
        return f"dp={self.dp} pp={self.pp} tp={self.tp}"


def _divisors(n: int) -> list[int]:
    """The divisors of n, in order, from its prime factors (trial division up to √n: a trillion devices take a
    million divisions, where trying every number up to n would never end)."""
    factors: dict[int, int] = {}
    rest, k = n, 2
    while k * k <= rest:
        while rest % k == 0:
            factors[k] = factors.get(k, 0) + 1
            rest //= k
        k += 1 if k == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    divisors = [1]
    for prime, power in factors.items():
        divisors = [d * prime ** e for d in divisors for e in range(power + 1)]
    return sorted(divisors)
