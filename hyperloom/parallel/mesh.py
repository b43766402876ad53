"""One device mesh for the whole job: named dimensions pp, dp, cp, tp, and the groups they imply.

The mesh is the only source of process groups, handed explicitly to the layers that need them.
It wraps `DeviceMesh`, so FSDP2 and distributed checkpointing understand its groups. Ranks are
row-major over `parallel.order` (default "pp,dp,cp,tp"): tp innermost, on the fastest links,
pp outermost, where slow links carry least (arXiv 2104.04473 §3.3). "dcp" names dp x cp
together: the ranks that hold the same weights and see different tokens, over which gradients
and optimizer state reduce (Megatron's data-context group). Expert parallelism folds over dcp,
so `ep` must divide dp x cp. HSDP (`parallel.dp_replicate`) splits each dcp line into
dp_replicate runs of consecutive ranks: "dp_shard" names a run (FSDP2 shards over it),
"dp_replicate" the ranks at the same place in every run (they hold the same shards and
all-reduce their gradients). Expert tensor parallelism (`parallel.etp`) cuts each tp line
into runs of etp consecutive ranks ("etp"); "etp_replica" names the ranks at the same place
in every run, which hold the same expert slices. A single process gets a mesh of size 1 and
no groups, and the layers skip their collectives.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hyperloom.accelerator import Accelerator
from hyperloom.config import ParallelConfig

log = logging.getLogger("hyperloom.parallel")

DIMS = ("pp", "dp", "cp", "tp")


def parse_order(order: str) -> tuple[str, ...]:
    """'pp,dp,cp,tp' -> ('pp', 'dp', 'cp', 'tp'); must name each dimension once."""
    names = tuple(n.strip() for n in order.split(",") if n.strip())
    if sorted(names) != sorted(DIMS):
        raise ValueError(
            f"parallel.order must name each of {', '.join(DIMS)} exactly once, got {order!r}"
        )
    return names


def exit_worker(rc: int) -> int:
    """Finish a torchrun worker without running C++ destructors at interpreter exit.

    Tearing down gloo process groups while Python finalises races with their worker
    threads and occasionally aborts a rank that had finished cleanly ("terminate called
    without an active exception"), which torchrun reports as a failed job. So a worker
    that joined a process group meets the others at a barrier (when it succeeded), tears
    the group down explicitly, flushes its output and leaves through `os._exit`. Without a
    process group it returns `rc`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return rc
    if rc == 0:
        dist.barrier()
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def init_distributed(acc: Accelerator) -> bool:
    """Join the process group torchrun announced (if any). Returns True when distributed."""
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist.init_process_group(backend=acc.backend)
    return True


@dataclass
class ParallelMesh:
    """Sizes, this rank's coordinates and the process groups of every mesh dimension."""

    sizes: dict[str, int]
    order: tuple[str, ...]
    device_mesh: object | None = None  # torch DeviceMesh when world > 1
    # expert tensor parallelism (`parallel.etp`): consecutive runs of etp ranks inside each
    # tp group split the routed experts' hidden width ("etp" in size, rank and group)
    etp: int = 1
    dp_replicate: int = 1  # HSDP replica groups along each dcp line (`parallel.dp_replicate`)
    _groups: dict[object, object] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def is_main(self) -> bool:
        """The rank that logs, writes metrics and draws the progress bar."""
        return self.global_rank == 0

    def size(self, dim: str) -> int:
        if dim == "etp":
            return self.etp
        if dim == "etp_replica":  # the tp ranks holding the same etp slice
            return self.sizes["tp"] // self.etp
        if dim == "dcp":
            return self.sizes["dp"] * self.sizes["cp"]
        if dim in ("dp_replicate", "dp_shard"):
            r = self.dp_replicate
            return r if dim == "dp_replicate" else self.size("dcp") // r
        return self.sizes[dim]

    def rank(self, dim: str) -> int:
        """This process's coordinate along `dim` (0 when the dimension has size 1); along
        "dcp", dp-major: dp rank x cp + cp rank."""
        if self.size(dim) == 1 or self.device_mesh is None:
            return 0
        if dim == "dcp":
            return self.rank("dp") * self.sizes["cp"] + self.rank("cp")
        if dim == "etp":
            return self.rank("tp") % self.etp
        if dim == "etp_replica":
            return self.rank("tp") // self.etp
        if dim in ("dp_replicate", "dp_shard"):
            run, place = divmod(self.rank("dcp"), self.size("dp_shard"))
            return run if dim == "dp_replicate" else place
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str):
        """Process group of `dim` (or "dcp", "etp", "etp_replica"), or None when it has size 1
        (nothing to communicate). "etp_replica": the tp / etp ranks of a tp group at the same
        place in their etp runs, which hold the same expert slices (their gradients are summed
        under sequence parallelism, `ParallelModel.finish_grads`). The "dcp" and "etp" groups
        are collectives to create the first time: every rank asks for them at the same point
        (`build_mesh` does)."""
        if self.size(dim) == 1 or self.device_mesh is None:
            return None
        if dim == "etp":
            if self.etp == self.sizes["tp"]:
                return self.group("tp")
            if dim not in self._groups:  # consecutive runs of etp ranks along each tp line
                etp, tp = self.etp, self.sizes["tp"]
                runs = [line[i : i + etp] for line in self._lines("tp") for i in range(0, tp, etp)]
                self._groups[dim] = self._new_groups(runs)
            return self._groups[dim]
        if dim == "etp_replica":
            if self.etp == 1:  # experts whole on every tp rank
                return self.group("tp")
            if dim not in self._groups:  # the ranks etp apart along each tp line
                etp = self.etp
                runs = [line[j::etp] for line in self._lines("tp") for j in range(etp)]
                self._groups[dim] = self._new_groups(runs)
            return self._groups[dim]
        if dim in ("dp_replicate", "dp_shard"):
            if self.dp_replicate == 1:  # plain FSDP2: one run, the whole dcp line
                return self.group("dcp") if dim == "dp_shard" else None
            if dim not in self._groups:
                self._groups[dim] = self._new_groups(self._hsdp_lines(dim))
            return self._groups[dim]
        if dim == "dcp" and 1 in (self.sizes["dp"], self.sizes["cp"]):
            return self.group("dp" if self.sizes["cp"] == 1 else "cp")
        if dim not in self._groups:
            if dim == "dcp":
                self._groups[dim] = self._new_groups(self._lines(dim))
            else:
                self._groups[dim] = self.device_mesh.get_group(dim)
        return self._groups[dim]

    def subgroup(self, dim: str, members: tuple[int, ...]):
        """Process group of the ranks at coordinates `members` along `dim` that share this
        rank's other coordinates (e.g. the first and last pipeline ranks, for tied
        embeddings). A collective: every rank calls it with the same arguments in the same
        order, because every such line of the mesh gets its own group. None if this rank's
        coordinate along `dim` is not in `members`."""
        key = (dim, tuple(members))
        if key not in self._groups:
            self._groups[key] = self._new_groups(
                [[line[i] for i in members] for line in self._lines(dim)]
            )
        return self._groups[key]

    def expert_groups(self, ep: int) -> tuple[object, object | None]:
        """(expert-parallel group, expert-data-parallel group or None) for experts folded
        over dp x cp (`parallel.expert_parallel`): along each dcp line, consecutive runs of
        `ep` ranks share out the experts, and ranks `ep` apart hold the same ones. A
        collective, like `subgroup`."""
        key = ("ep", ep)
        if key not in self._groups:
            dp, lines = self.size("dcp"), self._lines("dcp")
            ep_group = self._new_groups(
                [line[i : i + ep] for line in lines for i in range(0, dp, ep)]
            )
            data_group = None
            if dp > ep:
                data_group = self._new_groups([line[j::ep] for line in lines for j in range(ep)])
            self._groups[key] = (ep_group, data_group)
        return self._groups[key]

    def _lines(self, dim: str) -> list[list[int]]:
        """Global ranks of every line of the mesh along `dim` (other coordinates fixed);
        "dcp" lines run over dp and cp, dp-major (as `rank("dcp")` counts)."""
        grid = self.device_mesh.mesh
        dims = ("dp", "cp") if dim == "dcp" else (dim,)
        axes = [self.order.index(d) for d in dims]
        moved = grid.movedim(axes, list(range(-len(axes), 0)))
        return moved.reshape(-1, self.size(dim)).tolist()

    def _hsdp_lines(self, dim: str) -> list[list[int]]:
        """Each dcp line as runs of dp_shard consecutive ranks ("dp_shard"), or as the ranks
        at the same place in every run ("dp_replicate")."""
        n = self.size("dp_shard")
        lines = self._lines("dcp")
        if dim == "dp_shard":
            return [line[i : i + n] for line in lines for i in range(0, len(line), n)]
        return [line[j::n] for line in lines for j in range(n)]

    @staticmethod
    def _new_groups(rank_lists: list[list[int]]):
        """Create a group per list (every rank creates all of them, in the same order) and
        return the one this rank is in, or None."""
        mine, me = None, dist.get_rank()
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if me in ranks:
                mine = group
        return mine

    def submesh(self, *dims: str):
        """The DeviceMesh over `dims` (for FSDP2 and friends); "dcp" as one flat dimension;
        ("dp_replicate", "dp_shard") as HSDP's 2-D mesh over this rank's dcp line."""
        if self.device_mesh is None:
            return None
        if dims == ("dp_replicate", "dp_shard"):
            from torch.distributed.device_mesh import DeviceMesh

            line = next(x for x in self._lines("dcp") if self.global_rank in x)
            grid = torch.tensor(line).view(self.dp_replicate, -1)  # (replicas, shards)
            groups = [self.group("dp_replicate"), self.group("dp_shard")]
            kind = self.device_mesh.device_type
            return DeviceMesh.from_group(groups, kind, mesh=grid, mesh_dim_names=dims)
        if dims == ("dcp",):
            if 1 in (self.sizes["dp"], self.sizes["cp"]):
                return self.submesh("dp" if self.sizes["cp"] == 1 else "cp")
            from torch.distributed.device_mesh import DeviceMesh

            return DeviceMesh.from_group(self.group("dcp"), self.device_mesh.device_type)
        return self.device_mesh[dims if len(dims) > 1 else dims[0]]

    def describe(self) -> str:
        return " x ".join(f"{d}({self.sizes[d]})" for d in self.order) + f" = {self.world_size}"


def build_mesh(cfg: ParallelConfig, acc: Accelerator) -> ParallelMesh:
    """The job's mesh. Call after `init_distributed`; the config was validated against the
    world size already, so a mismatch here is a programming error."""
    order = parse_order(cfg.order)
    sizes = {d: getattr(cfg, d) for d in order}
    world = dist.get_world_size() if dist.is_initialized() else 1
    if math.prod(sizes.values()) != world:
        raise ValueError(f"mesh {sizes} does not match world size {world}")
    if world == 1:
        return ParallelMesh(sizes, order, etp=cfg.etp, dp_replicate=cfg.dp_replicate)
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(acc.kind, tuple(sizes.values()), mesh_dim_names=order)
    mesh = ParallelMesh(sizes, order, device_mesh, etp=cfg.etp, dp_replicate=cfg.dp_replicate)
    # collectives: made here, where every rank passes
    for dim in ("dcp", "etp", "etp_replica", "dp_replicate", "dp_shard"):
        mesh.group(dim)
    log.info("device mesh %s on %s (backend %s)", mesh.describe(), acc.kind, acc.backend)
    return mesh


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over `group`; a no-op without one."""
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    """Sum each tensor in place over `group` with one collective (flatten, all-reduce, copy
    back); a no-op without a group."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


@torch.no_grad()
def all_reduce_scaling_state(
    histories: list[torch.Tensor], scales: list[torch.Tensor], group, recent: int | None = None
) -> None:
    """Make delayed-scaling state equal over `group` in place, with one collective: amax
    histories by elementwise max, scales by min (TE reduces a tensor's amaxes over the ranks
    that hold it, `fp8_group`). `recent`: only the newest rows of each (..., len, columns)
    history (the quantizations since the last call), the older rows being equal already.
    A no-op without a group. Scales ride in the same MAX all-reduce, negated."""
    if group is None or not (histories or scales):
        return
    if recent is not None:
        histories = [h.narrow(-2, 0, min(recent, h.shape[-2])) for h in histories]
    parts = [h.reshape(-1) for h in histories] + [s.reshape(-1).neg() for s in scales]
    flat = torch.cat(parts)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    pieces = flat.split([p.numel() for p in parts])
    for h, part in zip(histories, pieces, strict=False):
        h.copy_(part.view_as(h))
    for s, part in zip(scales, pieces[len(histories) :], strict=True):
        s.copy_(part.neg().view_as(s))
