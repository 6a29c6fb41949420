"""Chapter 6's measurement: an untied input embedding and output head, kept in the root or wrapped as units.

    python -m minifsdp embedding-units --world-size 2 --markdown chapters/generated/embedding_units.md

The root keeps its full parameters from its forward to the end of its backward (chapter 6), so whatever the
root owns is unsharded all through the step. Left in the root, an untied embedding and head are two
vocabulary-sized matrices held whole beside every block; as units of their own they are gathered only
while they compute, for one all-gather more each per step. Every unit's full buffer is watched by the meter
as a category of its own, "unsharded", so its highest point is the unsharded bytes alive at once.
"""

from __future__ import annotations

import contextlib

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.fsdp import FullyShardedDataParallel
from minifsdp.measure.meter import CATEGORIES, MemoryMeter
from minifsdp.models import Block, GPTConfig, TinyGPT
from minifsdp.reports.format import fmt_bytes, md_table, write_report
from minifsdp.train import OPTIMIZERS, batch, loss_of

UNTIED = GPTConfig(vocab_size=1024, block_size=32, n_layer=4, n_head=4, n_embd=64, tie_weights=False)
WRAPS = ("in the root", "units of their own")


def embedding_policy(net: TinyGPT, own_units: bool):
    """Each block a unit; and, if `own_units`, the input embedding and the output head each a unit too."""
    own = (net.wte, net.lm_head) if own_units else ()
    return lambda module, unowned_numel: isinstance(module, Block) or any(module is m for m in own)


# --8<-- [start:measure]
def embedding_units(steps: int = 2) -> dict:
    """Per wrapping, in the last of `steps` steps (RAF, no prefetch: chapter 6's runtime): the unsharded bytes
    alive at once in forward and in backward, the step's peak, the all-gathers and bytes sent; and each
    unit's full size, for the model."""
    n, r = comm.world_size(), comm.rank()
    out = {}
    for label in WRAPS:
        net = TinyGPT(UNTIED)
        model = FullyShardedDataParallel(net, auto_wrap_policy=embedding_policy(net, label != "in the root"),
                                         backward_prefetch=None)
        opt = OPTIMIZERS["adamw"](model.parameters())
        meter = MemoryMeter(model, opt, categories=CATEGORIES + ("unsharded",))
        meter.watch([f._full for u in model.units() for f in u.flat_params], "unsharded")
        for step in range(steps):
            last = step == steps - 1
            with meter if last else contextlib.nullcontext(), comm.counting() as sent:
                meter.reset_peak()
                loss = loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu", UNTIED))
                forward = meter.category_peak["unsharded"]
                meter.reset_peak()
                loss.backward()
                backward, peak = meter.category_peak["unsharded"], meter.peak
                opt.step()
                opt.zero_grad()
        meter.close()
        out[label] = {"forward": forward, "backward": backward, "peak": peak, "bytes": sent.total(),
                      "all_gathers": sent.calls["all_gather"],
                      "units": {u.unit_name: sum(4 * f.shard_numel * n for f in u.flat_params)
                                for u in model.units()}}
    return out
# --8<-- [end:measure]


def unsharded_model(units: dict[str, int]) -> int:
    """RAF without prefetch: the root's full buffer all through the step, and one other unit's at a time."""
    return units["(root)"] + max(b for name, b in units.items() if name != "(root)")


def run_embedding_units_report(world_size: int = 2, markdown: str | None = None) -> dict:
    res = launch(embedding_units, world_size, device="cpu")[0]
    psi = sum(p.numel() for p in TinyGPT(UNTIED).parameters())
    rows = []
    for label, m in res.items():
        units = m["units"]
        size, name = max((b, name) for name, b in units.items() if name != "(root)")
        rows.append([label, f"{fmt_bytes(units['(root)'])} + {fmt_bytes(size)} ({name})",
                     f"{fmt_bytes(m['forward'])} / {fmt_bytes(m['backward'])}", fmt_bytes(unsharded_model(units)),
                     fmt_bytes(m["peak"]), f"{fmt_bytes(m['bytes'])} ({m['all_gathers']} all-gathers)"])
    text = (f"GPT with {UNTIED.n_layer} blocks and an untied embedding and output head, {UNTIED.vocab_size:,} x "
            f"{UNTIED.n_embd} each (Ψ = {psi:,}); blocks as units, reshard after forward, no prefetch; AdamW, "
            f"fp32, rank 0 of {world_size}, CPU, the second step\n\n"
            + md_table(["wte and lm_head", "full buffers: the root + the largest other unit",
                        "unsharded at once, forward / backward", "model", "peak of the step", "bytes sent"], rows))
    write_report(text, markdown)
    return res
