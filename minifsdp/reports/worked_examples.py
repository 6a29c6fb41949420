"""Chapter 13: the seeds' worked examples, through the simulator -- the PyTorch FSDP notes' 1.6B-parameter blocks
on 8 ranks, the ZeRO paper's 7.5B model on 64 GPUs, and the FSDP paper's rate limiter at 7B on 64 ranks.

    python -m minifsdp simulate --example all --markdown chapters/generated/worked_examples.md

Each example runs the real wrappers as rank 0 of N (minifsdp/measure/simulate.py) and sets what they measure next
to the figures the source prints.
"""

from __future__ import annotations

from minifsdp.measure import analytic
from minifsdp.measure.simulate import MODELS, Spec, simulate
from minifsdp.reports.format import fmt_size, md_folded, md_table

def example_fsdp_notes() -> dict:
    """The PyTorch FSDP notes' example: 1.6B-parameter fp32 blocks (one unit each) on 8 ranks, 10 of them.

    - 0.8 GB per collective per rank: the payload, each rank's shard of a unit, P·4/N = 1.6e9 · 4 / 8. The
      counter counts bytes *sent* on a ring, (N − 1)/N of the full buffer = 7 payloads; payload = sent / (N − 1).
    - 24 GB: the payloads of one step added up -- 10 blocks × 3 collectives (all-gather in forward, all-gather
      and reduce-scatter in backward) × 0.8 GB. Not memory: 10 unsharded blocks at once would be 64 GB.
    - 14.4 GB: the buffers at FSDP's peak, 2 communication buffers of 0.8 GB + 2 unsharded blocks of 6.4 GB:
      one block computing while the next one's all-gather lands. Measured with forward_prefetch=True and
      BACKWARD_PRE (two blocks unsharded at once in both passes). minifsdp's FlatParameter all-gathers in fp32
      straight from the shard into the unsharded buffer, and reduce-scatters in place: no communication
      buffers apart from those, so its peak holds the 12.8 GB of blocks, not 14.4."""
    spec = Spec(model="fsdp-notes", world_size=8, strategy="fsdp", seq_len=8, forward_prefetch=True, record=True)
    result = simulate(spec)
    n = spec.world_size
    blocks = [e for e in result["events"] if not e[2].endswith("(root)")]  # the notes leave the root out
    block = [u for u in result["units"] if u["name"] != "(root)"][0]
    return {"result": result, "block_numel": block["numel"], "block_padded": block["padded"],
            "payload_per_collective": {sent / (n - 1) for _, sent, _ in blocks},
            "collectives_per_step": len(blocks),
            "payloads_per_step": sum(sent / (n - 1) for _, sent, _ in blocks),
            "unsharded_peak": max(result["most"]["forward"]["unsharded"], result["most"]["backward"]["unsharded"]),
            "unsharded_peak_forward": result["most"]["forward"]["unsharded"],
            "unsharded_peak_backward": result["most"]["backward"]["unsharded"],
            "root_numel": sum(u["numel"] for u in result["units"] if u["name"] == "(root)"),
            "analytic_buffers": analytic.fsdp_buffer_bytes(block["numel"], n)}


ZERO_PAPER_GB = {"ddp": 120.0, "oss": 31.4, "sdp": 16.6, "fsdp": 1.9}  # its figure 1: Ψ = 7.5B, N = 64, K = 12


def example_zero(precisions=("bf16-master", "bf16")) -> dict:
    """The ZeRO paper's figure 1: Ψ = 7.5B on 64 GPUs with mixed-precision Adam (K = 12): model states per GPU
    of 120 GB (DDP, 16Ψ), 31.4 GB (ZeRO-1, 4Ψ + 12Ψ/N), 16.6 GB (ZeRO-2, 2Ψ + 14Ψ/N), 1.9 GB (ZeRO-3, 16Ψ/N).

    Model states here: parameters + gradients + optimizer state after the optimizer step, measured (the
    gradients are still there; ZeRO-3's full parameters are not: they are freed at the end of backward).
    The paper's accounting is "bf16-master" (MasterAdamW over a bf16 model); minifsdp's own MixedPrecision
    ("bf16") keeps the fp32 master as the parameter and fp32 gradients: the same 16 bytes per parameter, so
    the same DDP and ZeRO-3 totals, but ZeRO-1 and -2 shard less of them (8Ψ + 8Ψ/N and 4Ψ + 12Ψ/N)."""
    out = {}
    for precision in precisions:
        for strategy in ("ddp", "oss", "sdp", "fsdp"):
            # (one step: the model states after it are those after any step)
            r = simulate(Spec(model="zero-7.5b", world_size=64, strategy=strategy, precision=precision,
                              seq_len=8, warmup=False))
            after = r["phases"]["after optimizer step"]
            out[(precision, strategy)] = {"result": r, "params": after["params"], "grads": after["grads"],
                                          "optim": after["optim"],
                                          "states": after["params"] + after["grads"] + after["optim"],
                                          "analytic": r["analytic"]["model states"]["total"]}
    return out


def example_limit_all_gathers(world_size: int = 64, layers: int | None = None, seq_len: int = 4096) -> dict:
    """The FSDP paper's caching-allocator observation, at scale: 7b in bf16 on `world_size` ranks, the GPU as far
    behind the CPU as it can be (DeviceLag). Peak memory of full parameters (allocated, or freed but not yet
    reusable) with limit_all_gathers and without."""
    out = {}
    for limit in (True, False):
        r = simulate(Spec(model="7b", world_size=world_size, strategy="fsdp", precision="bf16", seq_len=seq_len,
                          layers=layers, limit_all_gathers=limit, device_lag=True))
        out[limit] = {"result": r, "forward": r["most"]["forward"]["unsharded"],
                      "backward": r["most"]["backward"]["unsharded"],
                      "peak": max(r["phases"][p]["total"] for p in ("peak of forward", "peak of backward"))}
    layer = [u for u in out[True]["result"]["units"] if u["name"] != "(root)"][0]["numel"]
    root = sum(u["numel"] for u in out[True]["result"]["units"] if u["name"] == "(root)")
    out["layer_bytes"], out["root_bytes"] = 2 * layer, 2 * root
    out["layers"] = layers or MODELS["7b"].n_layers
    return out


EXAMPLES = ("fsdp-notes", "zero-7.5b", "limit-all-gathers")


def zero_table(rows: list[list[str]]) -> str:
    """The ZeRO paper's four figures next to the simulator's, a row per stage: [stage, the paper, bf16-master's
    states, params, grads, optimizer, states rounded as the paper does, analytic, bf16's states, analytic], in
    GB as printed. What the states add up from is folded under it (six columns fit the docs' column)."""
    main = md_table(["stage", "the paper", "bf16-master: measured (rounded)", "analytic",
                     "bf16 (minifsdp's MixedPrecision): measured", "analytic"],
                    [[r[0], r[1], f"{r[2]} ({r[6]})", r[7], r[8], r[9]] for r in rows])
    split = md_table(["stage", "bf16-master: measured", "= params", "+ grads", "+ optimizer"],
                     [[r[0], r[2], r[3], r[4], r[5]] for r in rows])
    return main + "\n\n" + md_folded("bf16-master's model states: parameters, gradients and optimizer state", split)


def worked_examples_report(names=EXAMPLES) -> str:
    parts = []
    if "fsdp-notes" in names:
        e = example_fsdp_notes()
        gb = 1e9
        (payload,) = e["payload_per_collective"]
        r = e["result"]
        parts += [
            "**PyTorch FSDP notes: 1.6B-parameter fp32 blocks on 8 ranks**\n",
            f"`python -m minifsdp simulate --example fsdp-notes`: a model of 10 blocks of {e['block_numel']:,} "
            f"parameters (each block one FSDP unit, padded to {e['block_padded']:,}) and a root unit of "
            f"{e['root_numel']:,} (embedding, final norm, head), fp32, FSDP with forward_prefetch=True and "
            f"BACKWARD_PRE, rank 0 of 8, on meta tensors; the second step measured.\n",
            "| the notes | their figure | measured by the simulator | what it is |", "|---|---|---|---|",
            f"| payload per collective per rank | 0.8 GB | {payload / gb:.3f} GB | each rank's shard of a block, "
            f"P·4/N; the counter's bytes sent on the ring / (N − 1) |",
            f"| communications per step (10 blocks) | 30 | {e['collectives_per_step']} | all-gather in forward, "
            f"all-gather and reduce-scatter in backward, per block |",
            f"| total payload per step | 24 GB | {e['payloads_per_step'] / gb:.1f} GB | 30 × 0.8 GB: bytes "
            f"communicated per rank, not memory (10 blocks unsharded at once would be 64 GB) |",
            f"| unsharded blocks at the peak | 2 × 6.4 = 12.8 GB | forward {e['unsharded_peak_forward'] / gb:.1f} "
            f"GB, backward {e['unsharded_peak_backward'] / gb:.1f} GB | one block computing, the next one's "
            f"all-gather in flight (+ the root's {e['root_numel'] * 4 / 1e6:.2f} MB, kept from forward to "
            f"backward) |",
            "| communication buffers | 2 × 0.8 = 1.6 GB | 0 | minifsdp all-gathers from the shard itself into "
            "the unsharded buffer and reduce-scatters in place: none in fp32 (with bf16 compute, the cast "
            "shard, P·2/N, is one) |",
            f"| buffers in all | 14.4 GB | {e['unsharded_peak'] / gb:.1f} GB | analytic.fsdp_buffer_bytes: "
            f"{e['analytic_buffers']['total'] / gb:.1f} GB |",
            "",
            f"The notes also count the reduce-scatter's buffers in backward, \"2x buffer size\". At rank 0's "
            f"backward peak the meter finds {r['phases']['peak of backward']['other'] / gb:.1f} GB of gradients in "
            f"flight besides the two unsharded blocks: this block's per-parameter gradients, computed and not yet "
            f"concatenated into its flat gradient (6.4 GB), and the previous block's flat gradient, whose "
            f"reduce-scatter is in flight (6.4 GB); plus {r['phases']['peak of backward']['grads'] / gb:.1f} GB "
            f"of gradient shards already reduced. Just before the concatenation minifsdp frees the block's full "
            f"parameters and waits for the previous reduce-scatter (chapter 6), so the concatenation itself adds "
            f"nothing to the peak.\n"]
    if "zero-7.5b" in names:
        z = example_zero()
        psi = z[("bf16-master", "ddp")]["result"]["psi"]
        share = z[("bf16-master", "oss")]["result"]["stepped"] / (psi / 64)
        parts += [
            "**The ZeRO paper: Ψ = 7.5B on 64 GPUs, mixed-precision Adam (K = 12)**\n",
            f"`python -m minifsdp simulate --example zero-7.5b`: the paper's figure-1 model as a Llama-style "
            f"model of Ψ = {psi:,} (72 layers of dim 3072, Megatron-LM 8.3B's depth and width), rank 0 of 64, "
            f"one step; model states = parameters + gradients + optimizer state after the optimizer step (those "
            f"of any step), in GB (1e9 bytes).\n",
            zero_table([[label, f"{ZERO_PAPER_GB[strategy]}", *(f"{v / 1e9:.3f}" for v in (
                              z[("bf16-master", strategy)][k] for k in ("states", "params", "grads", "optim"))),
                          f"{z[('bf16-master', strategy)]['states'] / 1e9:.1f}",
                          *(f"{z[(precision, strategy)][k] / 1e9:.3f}" for precision, k in (
                              ("bf16-master", "analytic"), ("bf16", "states"), ("bf16", "analytic")))]
                         for strategy, label in (("ddp", "DDP (16Ψ)"), ("oss", "ZeRO-1, OSS (4Ψ + 12Ψ/N)"),
                                                 ("sdp", "ZeRO-2, SDP (2Ψ + 14Ψ/N)"),
                                                 ("fsdp", "ZeRO-3, FSDP (16Ψ/N)"))])]
        parts += ["",
                  "bf16-master is the paper's accounting: the model held in bf16 (parameters 2, gradients 2 bytes) and "
                  "`MasterAdamW` keeping fp32 master weights, momentum and variance (K = 12) for the parameters it "
                  "steps. minifsdp's own `MixedPrecision` keeps the fp32 master *as* the parameter (4 bytes), fp32 "
                  "gradients (4) and AdamW's moments (8), and makes bf16 copies only while computing: the same 16 "
                  "bytes per parameter, so DDP and ZeRO-3 agree with the paper, but ZeRO-1 shards only 8 of them "
                  "(8Ψ + 8Ψ/N) and ZeRO-2 only 12 (4Ψ + 12Ψ/N). The last digits: Ψ is not exactly 7.5B "
                  f"(16Ψ = {16 * psi / 1e9:.3f} GB), OSS gives rank 0 whole tensors ({share:.4f} Ψ/N here), FSDP "
                  "pads each unit to a multiple of N, and AdamW keeps a 4-byte step per tensor (MasterAdamW a "
                  "Python int).\n"]
    if "limit-all-gathers" in names:
        e = example_limit_all_gathers()
        parts += [
            "**The FSDP paper: the rate limiter, at 7B on 64 ranks**\n",
            "`python -m minifsdp simulate --example limit-all-gathers`: 7b, bf16 compute, FSDP (one unit per "
            "decoder layer, BACKWARD_PRE), rank 0 of 64, with `DeviceLag`: a GPU as far behind the CPU as it "
            "can be, so that a unit's freed buffer stays allocated until the CPU waits for that free. "
            "Peak memory of full parameters (in use, or freed by the CPU and not yet by the device):\n",
            "| | peak of forward | peak of backward | in layers (bf16) |", "|---|---|---|---|"]
        for limit in (True, False):
            f, b = e[limit]["forward"], e[limit]["backward"]
            in_layers = [(x - e["root_bytes"]) / e["layer_bytes"] for x in (f, b)]
            parts.append(f"| limit_all_gathers={limit} | {fmt_size(f)} | {fmt_size(b)} | "
                         f"{in_layers[0]:.1f} / {in_layers[1]:.1f} |")
        parts += ["",
                  f"A layer is {fmt_size(e['layer_bytes'])} in bf16; the root unit (embedding, norm, head), "
                  f"{fmt_size(e['root_bytes'])}, is held from forward to backward. With limit_all_gathers the CPU "
                  f"waits for the oldest free once two are pending, before it all-gathers into new memory: in forward "
                  f"the layer computing and one freed but not yet released by the device; in backward one more, "
                  f"the layer prefetched. Without it nothing bounds them: every layer, all {e['layers']}, is held "
                  f"until the CPU synchronises -- the whole model unsharded, at every step. On CPU ranks and on "
                  f"meta, compute is synchronous and the limiter never waits (without DeviceLag both rows read "
                  f"the root + one layer in forward, + two in backward); on a GPU the truth lies between the two "
                  f"rows, depending on how far the CPU runs ahead.\n"]
    return "\n".join(parts)
