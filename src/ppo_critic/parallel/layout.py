"""`ParallelLayout`: the one object saying how this job's ranks are laid out (dp, sp, tp, pp, vpp), where this rank
sits, and the process groups and mesh of each dimension. Built once per critic (`layout_of` here,
`backends.megatron.parallel.layout` from megatron's own groups) and passed to `parallelize`, the critics and the
worker, as torchtitan's `ParallelDims`.

Ranks of the data-parallel backend are laid out (dp, sp), so the ranks of one sp group are consecutive; the model is
sharded (or replicated) over all dp × sp ranks, which see different data or different pieces of a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ppo_critic.config.critic import CriticConfig, RankSizes


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes, this rank's coordinates and the groups of each parallel dimension; a single process is the default.
    `sizes_per_rank`: the config's batch sizes are this rank's already (a caller that cuts its own mini-batches,
    verl ≥ 0.9's engine), else its global sizes are divided over `dp`."""

    dp: int = 1
    sp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp_rank: int = 0
    sp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_group: object | None = None
    sp_group: object | None = None
    replica_group: object | None = None  # ranks computing one step together (sp; megatron's tp × pp): one batch each
    shard_mesh: object | None = None  # 1-D DeviceMesh of the dp × sp ranks the model is wrapped over; None: default
    sizes_per_rank: bool = False

    @property
    def data_ranks(self) -> int:
        """The ranks a gradient is averaged over in the data-parallel backend: dp × sp."""
        return self.dp * self.sp

    def rank_sizes(self, config: CriticConfig) -> RankSizes:
        """The batch sizes this rank runs with (`RankSizes`), per `sizes_per_rank`."""
        if self.sizes_per_rank:
            return RankSizes.as_given(config, self.dp)
        return RankSizes.over_ranks(config, self.dp)

    def per_rank(self) -> ParallelLayout:
        """This layout for a caller whose config's batch sizes are already this rank's."""
        return replace(self, sizes_per_rank=True)


def layout_of(config: CriticConfig) -> ParallelLayout:
    """The data-parallel backend's layout for `config` (its Ulysses size), over the default process group."""
    return data_parallel_layout(config.ulysses_sequence_parallel_size)


def data_parallel_layout(sp: int = 1) -> ParallelLayout:
    """The (dp, sp) layout of the default process group, with named meshes; a single process gets the default."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if sp != 1:
            raise ValueError(
                f"ulysses_sequence_parallel_size={sp} needs {sp} processes per sequence; launch with torchrun"
            )
        return ParallelLayout()
    world = dist.get_world_size()
    if world % sp:
        raise ValueError(f"world size {world} is not divisible by ulysses_sequence_parallel_size={sp}")
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world // sp, sp), mesh_dim_names=("dp", "sp"))
    return ParallelLayout(
        dp=world // sp,
        sp=sp,
        dp_rank=mesh["dp"].get_local_rank(),
        sp_rank=mesh["sp"].get_local_rank(),
        dp_group=mesh["dp"].get_group(),
        sp_group=mesh["sp"].get_group(),
        replica_group=mesh["sp"].get_group() if sp > 1 else None,
        shard_mesh=init_device_mesh(device, (world,), mesh_dim_names=("dp_sp",)),  # the default group's ranks
    )
