"""Chapter 10: one save and one load for every strategy, through PyTorch's distributed checkpoint (DCP).

    from minifsdp import checkpoint
    checkpoint.save("ckpt", model, optimizer, step=step, keep_last=3)   # every rank calls it
    info = checkpoint.load("ckpt", model, optimizer)                     # the newest one; info["step"]

A checkpoint is a DCP directory: one file of tensor bytes per rank (each rank writes only what it holds)
and a `.metadata` file that says which part of which tensor lies where. state.py says what each strategy
holds; this file puts it on disk so that nothing the user saved is lost:

- a save is atomic: it is written into `<name>.partial` and renamed only once every rank has finished, so
  a crash in the middle leaves the previous checkpoint as it was;
- a load reads nothing it does not understand: tensors only (DCP's `weights_only` reads), the metadata
  unpickled with an allow-list of DCP's own classes, the rest (step, hyper-parameters) as JSON;
- a load checks the checkpoint against the model first -- missing, unexpected and mis-shaped names, the
  optimizer's class -- and refuses, naming them, before anything is written;
- the step counter and every rank's random generators are saved, so a resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from minifsdp.checkpoint import state as held

FORMAT = "minifsdp-checkpoint/1"
STEP_DIR = re.compile(r"^step_(\d+)$")


# --8<-- [start:save]
def save(path, model: nn.Module, optimizer=None, *, step: int | None = None,
         extra: dict | None = None, keep_last: int | None = None) -> Path:
    """Save the model (and optimizer) state of every rank into one
    checkpoint; every rank calls it.

    step:      saved, and returned by load(); with it, `path` is a directory
               of checkpoints and this one is `path/step_<step>` (load(path)
               takes the newest); without it, `path` is the checkpoint.
    extra:     anything JSON can hold (a data loader's position, a config),
               returned by load().
    keep_last: with step, keep only the newest k checkpoints in `path`.
    """
    if keep_last is not None and (step is None or isinstance(keep_last, bool)
                                  or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ValueError(
            f"keep_last is a number of checkpoints >= 1 and needs step=..., "
            f"got keep_last={keep_last!r}, step={step!r}")
    target = Path(path) / f"step_{step:08d}" if step is not None else Path(path)
    partial = target.with_name(target.name + ".partial")
    rank = dist.get_rank() if dist.is_initialized() else 0
    # --8<-- [start:save_state]
    state = {
        "model": held.model_state(model),
        "meta": _encode({
            "format": FORMAT, "strategy": held.strategy_of(model, optimizer),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "step": step, "extra": extra,
            "optimizer": _optimizer_class(optimizer),
            "param_groups": optimizer and held.param_groups(model, optimizer),
            "buckets": held.bucket_order(model)}),
        "rng": {f"rank{rank}": _rng_state()}}
    if optimizer is not None:
        state["optim"] = {"state": held.optimizer_state(model, optimizer)}
    # --8<-- [end:save_state]
    # --8<-- [start:save_write]
    if rank == 0:
        # what a crashed save left behind
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    with _quiet():
        # each rank writes what it holds
        dcp.save(state, storage_writer=FileSystemWriter(partial))
    # every rank's bytes and the metadata are on disk after this barrier:
    # only now does it replace anything
    _barrier()
    if rank == 0:
        _publish(partial, target)
        if keep_last is not None:
            for old in _checkpoints(Path(path))[:-keep_last]:
                shutil.rmtree(old)
    _barrier()
    # --8<-- [end:save_write]
    return target
# --8<-- [end:save]


# --8<-- [start:publish]
def _publish(partial: Path, target: Path) -> None:
    """Put the finished checkpoint in place. A directory cannot be swapped for
    another in one step, so the old one steps aside first (`.old`); load()
    finds it there if a crash comes between the two renames."""
    old = target.with_name(target.name + ".old")
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(partial, target)
    shutil.rmtree(old, ignore_errors=True)
# --8<-- [end:publish]


# --8<-- [start:load]
def load(path, model: nn.Module, optimizer=None, *,
         strict: bool = True) -> dict:
    """Load a checkpoint saved by save() -- from any strategy, at any world
    size -- into this model (and optimizer), in place; every rank calls it.
    Returns {"step", "extra", "strategy", "world_size", "path",
    "missing_keys", "unexpected_keys"}. strict=False loads what matches and
    lists the rest."""
    found = resolve(path)
    reader = SafeFileSystemReader(found)
    metadata = reader.read_metadata()
    saved = {_key(metadata, k): md
             for k, md in metadata.state_dict_metadata.items()}
    pickled = sorted(".".join(k) for k, md in saved.items()
                     if not isinstance(md, TensorStorageMetadata))
    # DCP would unpickle these with torch.load(weights_only=False); minifsdp
    # never writes any
    if pickled:
        raise RuntimeError(f"checkpoint.load: {pickled} are pickled objects, "
                           f"not tensors: refusing to load them")
    meta = _load_meta(found, saved)
    with _quiet():
        missing, unexpected = check(saved, meta, model, optimizer, strict)
    rank = dist.get_rank() if dist.is_initialized() else 0
    # --8<-- [start:load_core]
    # a fresh optimizer has no state yet: make room for what will be loaded
    if optimizer is not None:
        held.make_optimizer_state(model, optimizer, _optimizer_entries(saved))
    dest = {"model": {k: v for k, v in held.model_state(model).items()
                      if ("model", k) in saved}}
    if optimizer is not None:
        optim_state = held.optimizer_state(model, optimizer)
        mine = {name: {key: v for key, v in keys.items()
                       if ("optim", "state", name, key) in saved}
                for name, keys in optim_state.items()}
        # (strict=False: none saved for some)
        mine = {name: keys for name, keys in mine.items() if keys}
        # an empty dict would reach DCP as a value of its own, which the
        # checkpoint lacks
        if mine:
            dest["optim"] = {"state": mine}
    rng = {k[2]: torch.empty(md.size, dtype=md.properties.dtype)
           for k, md in saved.items() if k[:2] == ("rng", f"rank{rank}")}
    if rng:
        dest["rng"] = {f"rank{rank}": rng}
    with _quiet():
        # each rank reads the parts of the saved tensors it now holds
        dcp.load(dest, storage_reader=reader)
    # --8<-- [end:load_core]
    if optimizer is not None and meta["param_groups"]:
        held.load_param_groups(model, optimizer, meta["param_groups"])
    _set_rng_state(rng)
    held.set_bucket_order(model, meta.get("buckets"))
    return {"step": meta["step"], "extra": meta["extra"],
            "strategy": meta["strategy"], "world_size": meta["world_size"],
            "path": found, "missing_keys": missing,
            "unexpected_keys": unexpected}
# --8<-- [end:load]


def resolve(path) -> Path:
    """The checkpoint `path` names: itself, the newest `step_*` inside it, or -- if a save was interrupted
    between its two renames -- the previous one, set aside as `<path>.old`."""
    path = Path(path)
    if (path / ".metadata").exists():
        return path
    old = path.with_name(path.name + ".old")
    if not path.exists() and (old / ".metadata").exists():
        warnings.warn(f"{path} is missing but {old} is complete: a save was interrupted while replacing it; "
                      f"loading the previous checkpoint")
        return old
    found = _checkpoints(path)
    if found:
        return found[-1]
    partial = path.with_name(path.name + ".partial")
    hint = f" ({partial} is an unfinished save)" if partial.exists() else ""
    raise FileNotFoundError(f"no checkpoint at {path}: neither a .metadata file nor step_* checkpoints "
                            f"inside it{hint}")


def _checkpoints(root: Path) -> list[Path]:
    """The complete step_* checkpoints in `root`, oldest first."""
    if not root.is_dir():
        return []
    done = [(int(m.group(1)), d) for d in root.iterdir() if (m := STEP_DIR.match(d.name))
            and (d / ".metadata").exists()]
    return [d for _, d in sorted(done)]


# --8<-- [start:check]
def check(saved: dict, meta: dict, model: nn.Module, optimizer,
          strict: bool) -> tuple[list, list]:
    """Refuse a checkpoint that does not fit, naming every problem, before
    anything is written."""
    if meta.get("format") != FORMAT:
        raise RuntimeError(f"not a minifsdp checkpoint (format "
                           f"{meta.get('format')!r}, expected {FORMAT!r})")
    expected = {k: tuple(v.shape) for k, v in held.model_state(model).items()}
    on_disk = {k[1]: tuple(md.size)
               for k, md in saved.items() if k[0] == "model"}
    missing = sorted(set(expected) - set(on_disk))
    unexpected = sorted(set(on_disk) - set(expected))
    problems = [] if not strict else [f"missing key {k!r}" for k in missing] + \
        [f"unexpected key {k!r}" for k in unexpected]
    problems += [f"size mismatch for {k!r}: the model has {expected[k]}, "
                 f"the checkpoint {on_disk[k]}"
                 for k in sorted(set(expected) & set(on_disk))
                 if expected[k] != on_disk[k]]
    if optimizer is not None:
        if meta["optimizer"] is None:
            problems.append("the checkpoint has no optimizer state (it was "
                            "saved without an optimizer)")
        elif meta["optimizer"] != _optimizer_class(optimizer):
            problems.append(f"the checkpoint's optimizer state is "
                            f"{meta['optimizer']}'s, this optimizer is "
                            f"{_optimizer_class(optimizer)}")
        strange = sorted(n for n in _optimizer_entries(saved)
                         if n not in expected)
        problems += [f"optimizer state for {n!r}, which the model does not have"
                     for n in strange if strict]
    if problems:
        raise RuntimeError("checkpoint.load: nothing was loaded, the model and "
                           "optimizer are unchanged:\n  "
                           + "\n  ".join(problems))
    return missing, unexpected
# --8<-- [end:check]


def _optimizer_entries(saved: dict) -> dict[str, dict[str, tuple]]:
    """{name: {key: (size, dtype)}} of the optimizer state in the checkpoint."""
    out = {}
    for k, md in saved.items():
        if k[:2] == ("optim", "state") and len(k) == 4:
            out.setdefault(k[2], {})[k[3]] = (md.size, md.properties.dtype)
    return out


def _key(metadata, flat_key: str) -> tuple:
    """A saved tensor's path (("model", name) or ("optim", "state", name, key)): DCP joins the levels of
    the nested state dict with dots, and keeps the path itself beside it, since names contain dots too."""
    return tuple(metadata.planner_data.get(flat_key, (flat_key,)))


# -- what is not a tensor: JSON in a byte tensor, so that reading it unpickles nothing --------------------------
def _encode(meta: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)


def _load_meta(found: Path, saved: dict) -> dict:
    md = saved.get(("meta",))
    if md is None:
        raise RuntimeError(f"{found} is a DCP checkpoint, but not minifsdp's (no 'meta' entry)")
    blob = torch.empty(md.size, dtype=torch.uint8)
    with _quiet():
        dcp.load({"meta": blob}, storage_reader=SafeFileSystemReader(found))
    return json.loads(bytes(blob.tolist()).decode())


def _optimizer_class(optimizer) -> str | None:
    if optimizer is None:
        return None
    inner = getattr(optimizer, "optim_class", None) or type(getattr(optimizer, "optim", optimizer))
    return inner.__name__


# -- random generators: each rank's own, so that a resumed run draws what the uninterrupted one drew -----------
def _rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(rng: dict[str, torch.Tensor]) -> None:
    """A rank the checkpoint had no generator for (it was saved at a smaller world size) keeps its own."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


# -- reading the metadata without unpickling arbitrary objects --------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its .metadata: allow DCP's own classes, torch.Size and dtypes, and nothing else."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem") \
                or (module, name) in self.ALLOWED \
                or (module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                                    torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint "
                                     f"never needs: refusing to load it")


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, with the metadata read through the allow-list above."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _quiet():
    """torch marks ShardedTensor (flat_chunks.py's pieces) deprecated in favour of DTensor, which cannot
    describe a flat shard's pieces; the warning says nothing the user can act on. And DCP's own error,
    CheckpointException, derives from BaseException, which `except Exception` does not catch: it is raised
    again as a RuntimeError, with DCP's message."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
        try:
            yield
        except CheckpointException as e:
            raise RuntimeError(f"torch.distributed.checkpoint failed: {e}") from e
