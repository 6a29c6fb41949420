"""Chapter 10's measurement: what taking a full state dict of an FSDP model costs each rank in memory.

    python -m minifsdp state-dict-memory --world-sizes 2 4 --markdown chapters/generated/state_dict_memory.md

Four ways of taking the same full state dict, on a GPT with several blocks (one unit per Block):

    whole model at once   chapter 6's first way: every unit unsharded together (summon_full_params), each
                          original copied out; rank0_only and offload_to_cpu only applied afterwards
    unit by unit          FULL_STATE_DICT now: one unit unsharded, copied out, resharded before the next
    + rank0_only          every rank all-gathers each unit, only rank 0 keeps a copy
    + offload_to_cpu      the copies go to host memory as each unit is gathered

Two kinds of bytes. The *working memory* is the unsharded unit buffers (the all-gathers' outputs): on a GPU
they are device memory whatever the config says, and they are what a checkpoint can run out of memory on.
The *result* is the state dict held at the end: device memory on a GPU, unless offload_to_cpu puts it in
host memory as it is made; on other ranks than 0 nothing, with rank0_only. On this CPU machine both are
host memory, so offload_to_cpu changes nothing in the numbers: its gain on a GPU is that the result's bytes
leave the device. The meter (minifsdp/measure/meter.py) sees every storage; the unsharded buffers are
watched as parameters, so their peak is read apart from the copies.
"""

from __future__ import annotations

import gc

from minifsdp.distributed.launch import launch
from minifsdp.fsdp import FSDP, FullStateDictConfig, ModuleWrapPolicy, StateDictType
from minifsdp.fsdp.state_dict import _all_units_at_once
from minifsdp.measure.meter import MemoryMeter, storage_bytes
from minifsdp.models import Block, GPTConfig, TinyGPT
from minifsdp.reports.format import fmt_bytes, write_report

# Several blocks that outweigh the root (embeddings, final norm): the unit by unit peak is one block's.
MODEL = GPTConfig(vocab_size=96, block_size=64, n_layer=8, n_head=4, n_embd=128, tie_weights=True)

WAYS = ("whole model at once", "unit by unit", "unit by unit, rank0_only", "unit by unit, rank0_only, offload_to_cpu")


def _take(model, way: str) -> dict:
    if way == "whole model at once":
        return _all_units_at_once(model)
    config = FullStateDictConfig(rank0_only="rank0_only" in way, offload_to_cpu="offload_to_cpu" in way)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return model.state_dict()


def measure_state_dict_memory(config: GPTConfig = MODEL) -> dict:
    """Inside ranks: per way, this rank's peak of unsharded buffers (working memory), the bytes of the state
    dict it holds at the end, and the peak of everything above what was live before; with the model's sizes."""
    model = FSDP(TinyGPT(config), auto_wrap_policy=ModuleWrapPolicy({Block}))
    flats = [flat for unit in model.units() for flat in unit.flat_params]
    shards = storage_bytes(model.parameters())
    out = {"units padded": {flat.name: 4 * flat.shard_numel * flat.world_size for flat in flats}}
    for way in WAYS:
        gc.collect()
        meter = MemoryMeter(model)
        meter.watch([flat._full for flat in flats], "params")  # the unsharded buffers: 0 bytes while sharded
        with meter:
            before = meter.live()["total"]
            meter.reset_peak()
            state = _take(model, way)
            out[way] = {"working": meter.category_peak["params"] - shards,
                        "result": storage_bytes(state.values()),
                        "peak": meter.peak - before}
        meter.close()
        del state
    return out


def report(world_sizes=(2, 4), markdown: str | None = None, config: GPTConfig = MODEL) -> dict:
    """Measure at each world size and print (and write, given a path) one table: rank 0, and the last rank
    for another (rank0_only leaves it without a result)."""
    results = {n: launch(measure_state_dict_memory, n, device="cpu", args=(config,)) for n in world_sizes}
    lines = ["| N | way | rank | unsharded buffers at peak (working memory) | state dict held at the end "
             "| peak above what was live before |", "|" + "---|" * 6]
    for n, ranks in results.items():
        for way in WAYS:
            for r in sorted({0, n - 1}):
                m = ranks[r][way]
                lines.append(f"| {n} | {way} | {r} | {fmt_bytes(m['working'])} | {fmt_bytes(m['result'])} "
                             f"| {fmt_bytes(m['peak'])} |")
    units = results[world_sizes[-1]][0]["units padded"]
    psi = sum(p.numel() for p in TinyGPT(config).parameters())
    write_report(
        f"Memory per rank of taking a full state dict: GPT of {config.n_layer} blocks (Ψ = {psi:,}, fp32), one "
        f"unit per Block, CPU. At N = {world_sizes[-1]} the units, padded, total {fmt_bytes(sum(units.values()))}; "
        f"the largest is {fmt_bytes(max(units.values()))}. Working memory: the unsharded unit buffers (device "
        f"memory on a GPU). The state dict held: the copies (device memory on a GPU unless offload_to_cpu; here "
        f"host memory either way, so offload_to_cpu shows no difference; a tied weight is copied under each of "
        f"its names, as PyTorch's FSDP1 does).\n\n" + "\n".join(lines), markdown)
    return results
