"""Sharded checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its own.

With `checkpoint.format = "sharded"` a save costs no gather and no rank needs room for the
whole model. Each rank hands DCP `model/<name>` and `optimizer/<name>/<key>` tensors that
describe the global tensor and its piece: tp, ep and etp shards as DTensors with
`Shard(dim)` (no copy), an expert weight split over ep and then over etp as one on the 2-D
(ep, etp) mesh (its offsets in the whole tensor along both dimensions), FSDP2 parameters as
the DTensors they are, replicated tensors plain (DCP writes one replica), ZeRO-1's flat
moments in per-parameter form (`state_by_param`), and a pipeline rank only the parameters
it reports. Loading reshards: a rank of any other layout asks for the
pieces it needs and DCP reads the overlapping bytes; one process loads whole tensors
(`load_full`). Small non-tensor state goes into `train_state.pt`, as in the whole format.
DCP is PyTorch's own format for this (torchtitan uses it) and does the resharding arithmetic.

The commit protocol is ours: DCP's `.metadata` carries no checksums and DCP expects an empty
directory. The main rank empties `step_N.tmp/`; every rank writes its shards there (in the
background: DCP's staging, then `dcp.save` in a thread of ours, which is what `dcp.async_save`
does, kept in hand so that a failed write can be retried), hashes them, and all ranks exchange
(ok, hashes); only if all succeeded does the main rank write the small files and `meta.json`
last, rename and prune (`commit`), then tell every rank. A failure is thus known to every rank,
which all retry once together. Background saves use their own gloo group, so their
collectives never interleave with training's.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hyperloom.checkpoint.commit import commit, hash_files, write_files
from hyperloom.checkpoint.layout import (
    CheckpointError,
    checkpoint_dir,
    discard_staging,
    fresh_staging_dir,
    staging_dir,
)
from hyperloom.checkpoint.state import optimizer_params, per_param_state
from hyperloom.checkpoint.writer import CheckpointWriter
from hyperloom.models.shard import shard_of
from hyperloom.parallel.layout import ParallelModel
from hyperloom.parallel.zero1 import ZeroOneAdamW

MODEL, OPTIMIZER = "model/", "optimizer/"

# One process saves and loads without a process group on purpose (single-device runs,
# `hyperloom generate`); DCP would warn on every call that it assumes so.
warnings.filterwarnings(
    "ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning
)


# --------------------------------------------------------------------------- layout


class _Layout:
    """How this rank's tensors sit inside the global ones (see the module doc)."""

    def __init__(self, pm: ParallelModel) -> None:
        self.pm = pm
        self._meshes: dict[tuple[str, ...], object] = {}

    def placement(self, p: torch.Tensor):
        """(mesh, placements) of a sharded parameter: one mesh dimension per split of its
        `Shard`, outermost first, each a `Shard(dim)` of the whole tensor. A tp or ep slice
        lies on a 1-D mesh; an expert weight split over ep and then over etp on the 2-D
        (ep, etp) mesh of this rank's two groups, so DCP records the slice's offsets in the
        whole tensor along both dimensions and any layout reads the bytes it needs."""
        chain = shard_of(p).chain()
        key = tuple(s.over for s in chain)
        if key not in self._meshes:
            self._meshes[key] = self._mesh(key, [self.pm.group_of(s) for s in chain])
        return self._meshes[key], [Shard(s.dim) for s in chain]

    def _mesh(self, dims: tuple[str, ...], groups: list):
        from torch.distributed.device_mesh import DeviceMesh

        if dims == ("tp",):
            return self.pm.mesh.submesh("tp")
        kind = self.pm.mesh.device_mesh.device_type
        if len(groups) == 1:
            return DeviceMesh.from_group(groups[0], kind)
        # Global ranks are linear in the mesh coordinates (row-major), so the rank at place
        # (i, j, ...) is this rank moved along each group by its member's offset from here.
        me = dist.get_rank()
        grid = torch.tensor(me)
        for group in groups:
            offsets = torch.tensor(dist.get_process_group_ranks(group)) - me
            grid = grid[..., None] + offsets  # (size_0, ..., size_k)
        return DeviceMesh.from_group(groups, kind, mesh=grid, mesh_dim_names=dims)

    def global_view(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`t` (parameter `p` or a moment shaped like it) as DCP should see it."""
        t = t.detach()
        if shard_of(p) is None:
            return t  # replicated, or an FSDP2 DTensor over dp
        if isinstance(t, DTensor):  # FSDP2 x tp: this rank's tp piece, whole over dp
            t = t.full_tensor()
        return DTensor.from_local(t, *self.placement(p), run_check=False)

    def empty_like(self, p: torch.Tensor) -> torch.Tensor:
        """A load target laid out like `global_view(p)`."""
        if shard_of(p) is None:
            return torch.empty_like(p.detach())
        # p.shape is this rank's tp piece (for an FSDP2 DTensor: its shape over dp).
        local = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        return DTensor.from_local(local, *self.placement(p), run_check=False)


@torch.no_grad()
def _fill(dst: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Copy a loaded `value` (laid out by `_Layout.empty_like`) into `dst`; returns `dst`."""
    if isinstance(value, DTensor) and not isinstance(dst, DTensor):
        value = value.to_local()  # a tp piece into a plain parameter
    elif isinstance(dst, DTensor) and value.shape != dst.shape:
        piece = value.to_local() if isinstance(value, DTensor) else value
        value = distribute_tensor(piece, dst.device_mesh, dst.placements)  # FSDP2 x tp
    if isinstance(dst, DTensor):
        dst.to_local().copy_(value.to_local())
    else:
        dst.copy_(value)
    return dst


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).cpu()


# --------------------------------------------------------------------------- state


def sharded_state(pm: ParallelModel, opt) -> dict[str, torch.Tensor]:
    """This rank's model and optimizer state as DCP's flat dict (a collective under ZeRO-1)."""
    lay = _Layout(pm)
    out = {f"{MODEL}{name}": lay.global_view(p, p) for name, p in pm.state_params()}
    names = {id(p): (n, p) for n, p in pm.local_params()}
    reported = {id(p) for _, p in pm.state_params()}
    for p, st in per_param_state(opt).items():
        if id(p) not in reported:  # another copy of this parameter reports it
            continue
        name, param = names[id(p)]
        for k, v in st.items():
            key = f"{OPTIMIZER}{name}/{k}"
            out[key] = _scalar(v) if v.dim() == 0 else lay.global_view(v, param)
    return out


def _full_shape(p: torch.Tensor) -> tuple[int, ...]:
    shard = shard_of(p)
    return tuple(p.shape if shard is None else shard.whole_shape(p.shape))


def _check_model(copies: dict[str, list[torch.Tensor]], saved: dict, pipelined: bool) -> None:
    """The checkpoint holds every parameter of this rank, whole-shaped as the model needs."""
    in_ckpt = {k[len(MODEL) :] for k in saved if k.startswith(MODEL)}
    missing = set(copies) - in_ckpt
    # A pipeline rank holds a part of the model: the rest of the state is other ranks'.
    unexpected = set() if pipelined else in_ckpt - set(copies)
    if missing or unexpected:
        raise KeyError(
            f"state does not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for name, (p, *_) in copies.items():
        size = tuple(saved[MODEL + name].size)
        if size != _full_shape(p):
            raise ValueError(f"{name}: checkpoint has shape {size}, model needs {_full_shape(p)}")


def _moment_keys(saved: dict) -> dict[str, dict[str, str]]:
    """Parameter name -> optimizer state key (exp_avg, step, ...) -> DCP key."""
    moments: dict[str, dict[str, str]] = defaultdict(dict)
    for key in saved:
        if key.startswith(OPTIMIZER):
            name, _, k = key[len(OPTIMIZER) :].rpartition("/")
            moments[name][k] = key
    return moments


@torch.no_grad()
def load_sharded_state(pm: ParallelModel, opt, path: Path) -> None:
    """Load a sharded checkpoint into this rank's parameters and optimizer, whatever layout
    wrote it (a collective: every rank of the job calls it)."""
    reader = dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    lay = _Layout(pm)
    copies: dict[str, list[torch.nn.Parameter]] = defaultdict(list)
    for name, p in pm.local_params():
        copies[name].append(p)
    _check_model(copies, saved, pm.pipelined)
    # Load targets laid out for this rank, then copied into every parameter copy.
    targets = {MODEL + name: lay.empty_like(p) for name, (p, *_) in copies.items()}
    names, in_ckpt = {id(p): n for n, p in pm.local_params()}, _moment_keys(saved)
    moments = {p: in_ckpt.get(names[id(p)], {}) for p in optimizer_params(opt)}
    for p, keys in moments.items():
        if not keys and isinstance(opt, ZeroOneAdamW):
            raise KeyError(f"optimizer state has no entry for {names[id(p)]}")
        for key in keys.values():
            scalar = len(saved[key].size) == 0  # Adam's step counter
            dtype = saved[key].properties.dtype
            targets[key] = torch.empty((), dtype=dtype) if scalar else lay.empty_like(p)
    _load(targets, reader)
    for name, ps in copies.items():
        for p in ps:
            _fill(p, targets[MODEL + name])
    state = {
        p: {
            k: targets[key] if targets[key].dim() == 0 else _fill(torch.empty_like(p), targets[key])
            for k, key in keys.items()
        }
        for p, keys in moments.items()
    }
    _restore_optimizer(opt, state)


def _restore_optimizer(opt, state: dict[torch.nn.Parameter, dict[str, torch.Tensor]]) -> None:
    """Give each parameter its loaded state, this rank's piece, shaped like the parameter."""
    if isinstance(opt, ZeroOneAdamW):
        opt.load_state_by_param(state)
        return
    for group in opt.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            entry = state[p]
            if "step" in entry and on_device:  # the fused kernels keep it on the device
                entry["step"] = entry["step"].to(p.device)
            if entry:
                opt.state[p] = entry
            else:  # saved before the first step
                opt.state.pop(p, None)


def _load(targets: dict[str, torch.Tensor], reader, no_dist: bool = False) -> None:
    """`dcp.load` in place; one process (`no_dist`, or no process group) reads alone."""
    no_dist = no_dist or not (dist.is_available() and dist.is_initialized())
    dcp.load(targets, storage_reader=reader, no_dist=no_dist)


def load_full(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a sharded checkpoint whole, in this process alone (no collective):
    (model state, optimizer state as `{"state": {name: {key: tensor}}}`)."""
    reader = dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    targets = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in saved.items()
        if hasattr(m, "size")
    }
    _load(targets, reader, no_dist=True)
    model = {k[len(MODEL) :]: v for k, v in targets.items() if k.startswith(MODEL)}
    state: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, v in targets.items():
        if key.startswith(OPTIMIZER):
            name, _, k = key[len(OPTIMIZER) :].rpartition("/")
            state[name][k] = v
    return dict(sorted(model.items())), {"state": dict(state)}


# --------------------------------------------------------------------------- writer


def _first_failure(exc: BaseException) -> BaseException:
    """DCP wraps the failures of every rank in one CheckpointException whose text is a
    traceback per rank; the report names the first failing rank's own exception."""
    if isinstance(exc, CheckpointException) and exc.failures:
        return min(exc.failures.items())[1][0]
    return exc


class _Stream:
    """A file DCP writes through that keeps the OSError of a failed write: torch.save inside
    DCP reports it only as "[enforce fail at inline_container.cc] unexpected pos"."""

    def __init__(self, f, errors: list[OSError]) -> None:
        self._f, self._errors = f, errors

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self._errors.append(exc)
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            self._errors.append(exc)
            raise

    def __getattr__(self, name: str) -> Any:  # tell, seek, fileno, close ...
        return getattr(self._f, name)


class _FileSystem(FileSystem):
    """DCP's local file system, whose streams keep their write errors (`_Stream`)."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as f:
            yield _Stream(f, self.errors)


class _ShardWriter(dcp.FileSystemWriter):
    """DCP's file writer (fsynced), with a drill hook: `after_first_file` runs once this
    rank's shard files are written, inside DCP's write step (for async saves, DCP's
    background thread), so a save fault leaves what a real one would: shards but no
    `.metadata`, and DCP reports the failure to every rank."""

    def __init__(self, path: Path, after_first_file: Callable[[], None] | None) -> None:
        super().__init__(str(path), sync_files=True)
        self.fs = _FileSystem()
        self.after_first_file = after_first_file

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        if self.after_first_file is not None:
            written.wait()
            self.after_first_file()
        return written


class ShardedCheckpointWriter(CheckpointWriter):
    """`CheckpointWriter` for the sharded format: every rank calls `save` with its own
    `sharded_state`; the main rank's `train_state` and `extra_files` join the checkpoint.

    Create it on every rank at the same point (it makes the process group of its saves)."""

    def __init__(self, run_dir: Path, keep: int, async_save: bool, on_failure=None) -> None:
        super().__init__(run_dir, keep, async_save, on_failure)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.rank = dist.get_rank() if self.distributed else 0

    def save(
        self,
        step: int,
        model_state: dict[str, torch.Tensor],
        train_state: dict[str, Any],
        extra_files: dict[str, str | bytes],
        meta: dict[str, Any],
        protect: frozenset[int] = frozenset(),
        after_first_file: Callable[[], None] | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> Path:
        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        if self.rank == 0:
            buf = io.BytesIO()
            torch.save(train_state, buf)  # small; serialised now, before training moves on
            extra_files = {**extra_files, "train_state.pt": buf.getvalue()}
        finish = (step, extra_files, meta, protect, after_first_file)
        if self.async_save:
            # DCP's own staging, as `dcp.async_save` does it (private CPU copies), kept here
            # so that a failed write can be retried from the same copy.
            staged = _ShardWriter(staging_dir(self.run_dir, step), None).stage(model_state)
            self._thread = threading.Thread(
                target=self._finish,
                args=(staged, *finish),
                name=f"hyperloom-dcp-{step}",
                daemon=True,
            )
            self._thread.start()
        else:
            self._finish(model_state, *finish)
            self._raise_pending()
        self.stall_s.append(time.perf_counter() - start)
        return checkpoint_dir(self.run_dir, step)

    def _finish(
        self,
        state: dict[str, torch.Tensor],
        step: int,
        files: dict[str, str | bytes],
        meta: dict[str, Any],
        protect: frozenset[int],
        after_first_file: Callable[[], None] | None,
    ) -> None:
        """Write and commit on every rank; once more if that fails (every rank knows, so all
        retry together; the drill's fault, which strikes once, is left out of the retry)."""
        failed: BaseException | None = None
        for hook in (after_first_file, None):
            error = self._attempt(state, step, files, meta, protect, hook)
            if error is None:
                self.last_committed = checkpoint_dir(self.run_dir, step)
                if failed is not None:
                    self._failures.append((step, failed, True))
                return
            if failed is not None:
                self._failures.append((step, error, False))
                return
            failed = error

    def _attempt(
        self,
        state: dict[str, torch.Tensor],
        step: int,
        files: dict[str, str | bytes],
        meta: dict[str, Any],
        protect: frozenset[int],
        after_first_file: Callable[[], None] | None,
    ) -> BaseException | None:
        """Steps 1-5 of the protocol (module doc) on every rank: None when committed, else
        the error, the same outcome on every rank; a failed attempt leaves no `step_N.tmp/`."""
        tmp = staging_dir(self.run_dir, step)
        error: BaseException | None = None
        try:
            if self.rank == 0:
                fresh_staging_dir(self.run_dir, step)
        except BaseException as exc:  # noqa: BLE001 - told to every rank below
            error = exc
        # Every rank waits for the empty directory, and learns whether it could be made.
        if not self._gather(error is None)[0]:
            if self.rank == 0:
                discard_staging(self.run_dir, step)
            return error or CheckpointError(f"the main rank could not create {tmp}")
        hashes: dict[str, str] = {}
        writer = _ShardWriter(tmp, after_first_file)
        if self.async_save:
            writer.per_thread_copy_ahead = 0  # the state is staged on the CPU already
        try:
            no_dist = not self.distributed
            # A rank's failure inside DCP's write fails it on every rank.
            dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=no_dist)
            # Each rank hashes the shard files it wrote (in parallel); the main rank the rest.
            hashes = hash_files(tmp, f"__{self.rank}_*.distcp")
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - agreed on below, then reported
            error = _first_failure(exc)
        # A write that failed on some rank: its file system's own error (e.g. a full disk)
        # says more than the exception DCP hands every rank.
        own = writer.fs.errors[0] if writer.fs.errors else None
        reports = self._gather((error is None, hashes, own))
        if error is not None:
            error = next((e for _, _, e in reports if e is not None), error)
        committed = None
        if self.rank == 0 and error is None:
            failed = [r for r, (ok, _, _) in enumerate(reports) if not ok]
            if failed:
                error = CheckpointError(f"ranks {failed} did not finish writing their shards")
            else:
                try:
                    for _, h, _ in reports:
                        hashes.update(h)
                    hashes.update(write_files(tmp, files))
                    hashes.update(hash_files(tmp, skip=hashes))  # DCP's .metadata
                    committed = commit(self.run_dir, step, hashes, meta, self.keep, protect)
                except BaseException as exc:  # noqa: BLE001 - told to every rank below
                    error = exc
        if not self._gather(committed is not None)[0] and error is None:
            error = CheckpointError("the main rank did not commit it")
        if error is not None and self.rank == 0:
            discard_staging(self.run_dir, step)  # every rank is done writing into it
        return error

    def _gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out
