"""Chapter 5's measurement: the gradient bytes of one unit, around its backward and its reduce-scatter.

    python -m minifsdp grad-buffers --world-size 2 --markdown chapters/generated/gradient_buffers.md

The gradients do not arrive flat for free: the views of a unit are cut by one split of its flat parameter,
and the backward of a split is a concatenation. Autograd first makes each parameter's gradient as a tensor
of its own, then copies them, with zeros for the gaps, into a new flat gradient. Both are alive while it
runs: two flat sizes. The meter shows it on one unit of two linear layers of odd sizes (so that the layout
has gaps), fed one row, so that the activations are a few hundred bytes next to the gradients' tens of kB.
Torch's FSDP1, on the same unit, is measured beside it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.fsdp import FullyShardedDataParallel
from minifsdp.measure import analytic
from minifsdp.measure.meter import CATEGORIES, MemoryMeter
from minifsdp.reports.format import fmt_bytes, md_table, write_report

D_IN, D_HIDDEN, D_OUT = 60, 50, 30


def one_unit() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Linear(D_HIDDEN, D_OUT))


def _loss(model) -> torch.Tensor:
    return model(torch.ones(1, D_IN)).square().sum()


# --8<-- [start:measure]
def unit_gradient_buffers() -> dict:
    """One backward of one unit (the root, so that it keeps its parameters from forward), on this rank.

    The full parameters are watched as a category of their own ("unsharded"), so that "other" holds the
    gradients (and the one-row activations). Its highest point is read twice: up to the end of the split's
    backward (a hook on that autograd node), and from the moment the runtime has issued the reduce-scatter
    (a gradient hook registered after the runtime's own) to the moment its wait returns, just before the
    shard is copied out. Not later: gloo's worker thread drops its buffer a moment after waking the
    waiter, and now and then the copy-out comes first, so a later reading would change from run to run."""
    model = FullyShardedDataParallel(one_unit(), backward_prefetch=None)
    flat = model.flat_params[0]
    meter = MemoryMeter(model, categories=CATEGORIES + ("unsharded",))
    meter.watch([flat._full], "unsharded")
    peaks = {}

    def concat_done(grad_inputs, grad_outputs):  # the flat gradient exists; the pieces are still alive
        peaks["concat"] = meter.category_peak["other"]

    def waited(grad_shard, read_now=False, copy_out=flat.grad_for_optimizer):  # once the wait returns
        peaks["reduce_scatter"] = meter.category_peak["other"]
        return copy_out(grad_shard, read_now)

    flat.grad_for_optimizer = waited
    flat.param.register_post_accumulate_grad_hook(lambda p: meter.reset_peak())  # runs after the runtime's
    with meter:
        loss = _loss(model)
        flat.concat_node.register_hook(concat_done)  # the views this forward used were cut by this node
        meter.reset_peak()
        loss.backward()
        kept = meter.live()["grads"]
    meter.close()
    return {"numel": flat.numel, "padded": flat.shard_numel * comm.world_size(), "kept": kept, **peaks}
# --8<-- [end:measure]


def torch_fsdp1_gradient_buffers() -> dict:
    """The same unit under torch's FSDP1, on the CPU: the highest live bytes in backward, and what is in it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    model = TorchFSDP(one_unit(), device_id=torch.device("cpu"))
    flat = next(model.parameters())  # its one FlatParameter (the shard)
    meter = MemoryMeter(model)  # refresh=True: torch resizes its storages without announcing it
    with meter:
        loss = _loss(model)
        meter.reset_peak()
        loss.backward()
    meter.close()
    n = comm.world_size()
    return {"numel": sum(p.numel() for p in one_unit().parameters()), "padded": flat.numel() * n,
            "peak": meter.peak, "shard": flat.numel() * 4}


def measure() -> dict:
    return {"ours": unit_gradient_buffers(), "torch": torch_fsdp1_gradient_buffers()}


def run_grad_buffers_report(world_size: int = 2, markdown: str | None = None) -> dict:
    res = launch(measure, world_size, device="cpu")[0]
    ours, theirs = res["ours"], res["torch"]
    flat = 4 * ours["padded"]
    model = analytic.fsdp_gradient_bytes(ours["padded"], world_size)
    rows = [["the split's backward: the per-parameter gradients and their concatenation", ours["concat"],
             model["concat"]],
            ["the reduce-scatter: the flat gradient and gloo's buffer of its size", ours["reduce_scatter"],
             model["reduce_scatter"]],
            ["after backward: the shard in `.grad`", ours["kept"], model["kept"]]]
    lines = [(f"One unit, `nn.Linear({D_IN}, {D_HIDDEN})` and `nn.Linear({D_HIDDEN}, {D_OUT})`: "
              f"{ours['numel']:,} parameters, padded with its gaps to {ours['padded']:,} (one flat gradient: "
              f"{fmt_bytes(flat)}), one row of input, fp32, rank 0 of {world_size}, gloo\n"),
             md_table(["moment", "gradient bytes alive, measured", "model", "in flat gradients"],
                      [[what, fmt_bytes(got), fmt_bytes(want), f"{got / flat:.3f}"] for what, got, want in rows]),
             ""]
    t_flat = 4 * theirs["padded"]
    t_rest = theirs["peak"] - theirs["shard"] - t_flat
    lines.append(f"torch's FSDP1 on the same unit (packed end to end: {theirs['padded']:,} elements, "
                 f"{fmt_bytes(t_flat)}): the highest live bytes in backward are {fmt_bytes(theirs['peak'])}: "
                 f"the shard ({fmt_bytes(theirs['shard'])}), the full parameters it still holds "
                 f"({fmt_bytes(t_flat)}) and {fmt_bytes(t_rest)} more, {t_rest / t_flat:.3f} flat gradients.")
    write_report("\n".join(lines), markdown)
    return res
