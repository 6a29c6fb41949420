"""Chapter 12's report, the column layers' input-gradient all-reduce behind their weight-gradient matmul
(`python -m minifsdp parallel --parts overlap`): TinyGPT (h = 256, 2 blocks, 2,048 tokens) over t = 2 ranks, one
backward at a time on a Timeline, with f's synchronous all-reduce and with async_grad_allreduce (the column layer
starts its input gradient's all-reduce, computes its weight gradient, then waits), median of 5 each, the paths taking
turns: backward time, the column layers' matmuls, the all-reduces, the time held by them (in their call or their
wait), the share of their time not held (hidden_fraction); both paths' gradients compared bit for bit; the two
timelines of rank 0, one above the other.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from minifsdp import events
from minifsdp.distributed.launch import launch
from minifsdp.measure.timeline import Span, Timeline, hidden_fraction, lane_time
from minifsdp.models import GPTConfig, TinyGPT, gpt_batch
from minifsdp.parallel import ColumnParallelLinear, TensorParallelGPT
from minifsdp.reports import style
from minifsdp.reports.format import fmt_bytes
from minifsdp.reports.parallel.tp import named_group

# the input gradient's all-reduce behind the weight gradient: b s = 2,048 tokens, wide enough that a column layer's
# weight-gradient matmul takes milliseconds on one CPU core, and about as long as gloo takes to all-reduce its input
# gradient (2 MiB) between two processes of one machine -- no simulated link needed
OVERLAP_CONFIG = GPTConfig(n_layer=2, n_embd=256, n_head=8, vocab_size=256, block_size=128)
OVERLAP_BATCH, OVERLAP_REPS = 16, 5
PATHS = {"synchronous": False, "async_grad_allreduce": True}  # TensorParallelGPT's async_grad_allreduce


def _is_input_gradient(tag: str) -> bool:
    """A column layer's input-gradient collective: f's backward all-reduce (the synchronous path) or the one the
    column layer starts itself (the async path)."""
    return tag == "f backward" or tag.endswith(" input gradient")


def _column_weights(model: TensorParallelGPT) -> dict:
    """Each column-parallel weight, and the name its layer goes by in the timeline (the tied head: "lm_head")."""
    weights = {m.weight: m.name for m in model.modules() if isinstance(m, ColumnParallelLinear)}
    if model.tied:
        weights[model.wte.weight] = "lm_head"
    return weights


def mark_column_matmuls(loss: torch.Tensor, weights: dict) -> None:
    """On the synchronous path autograd computes a column layer's two backward matmuls, dL/dx and dL/dW, in one
    node (F.linear's AddmmBackward0 or MmBackward0); f's all-reduce follows, in a node of its own. Announce each
    such node of `loss`'s graph to the timeline as "backward {layer} input + weight gradients" (the async path
    announces its weight-gradient matmul itself). The hooks go with the graph."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nexts = [n for n, _ in node.next_functions if n is not None]
        todo.extend(nexts)
        if node.name() not in ("AddmmBackward0", "MmBackward0"):
            continue
        for n in nexts:  # the weight enters F.linear transposed: node -> TBackward0 -> AccumulateGrad(weight)
            leaves = [m for m, _ in n.next_functions if m is not None] if n.name() == "TBackward0" else []
            layer = next((weights[m.variable] for m in leaves if hasattr(m, "variable") and m.variable in weights),
                         None)
            if layer is not None:
                label = f"backward {layer} input + weight gradients"
                node.register_prehook(lambda grads, label=label: events.emit(events.COMPUTE_BEGIN, label))
                node.register_hook(lambda inputs, outputs, label=label: events.emit(events.COMPUTE_END, label))


def overlap_measure(config: GPTConfig = OVERLAP_CONFIG, b: int = OVERLAP_BATCH, reps: int = OVERLAP_REPS) -> dict:
    """On each rank of a tensor-parallel group of every rank: one TensorParallelGPT per path, from the same TinyGPT;
    reps + 1 backward passes of each (the paths taking turns to go first; the first pass warms up), each recorded on
    a Timeline: its spans, its wall time. The paths' gradients, compared bit for bit."""
    group = named_group("tp")
    x, y = gpt_batch(config, 0, b)
    models = {path: TensorParallelGPT.from_gpt(TinyGPT(config, seed=0), group=group, async_grad_allreduce=a)
              for path, a in PATHS.items()}
    weights = _column_weights(models["synchronous"])
    out, grads = {path: [] for path in PATHS}, {}
    for rep in range(reps + 1):
        for path in list(PATHS)[:: 1 if rep % 2 else -1]:
            model = models[path]
            loss = model(x, y)
            if not PATHS[path]:
                mark_column_matmuls(loss, weights)
            with Timeline() as tl:
                t0 = time.perf_counter()
                with tl.span("backward"):
                    loss.backward()
                wall = time.perf_counter() - t0
            if rep == 0:
                grads[path] = {k: p.grad.clone() for k, p in model.named_parameters()}
            else:
                out[path].append({"wall": wall, "spans": tl.spans()})
            model.zero_grad(set_to_none=True)
    sync, asynchronous = grads["synchronous"], grads["async_grad_allreduce"]
    out["grad_diff"] = max((sync[k] - asynchronous[k]).abs().max().item() for k in sync)
    out["grads_identical"] = all(torch.equal(sync[k], asynchronous[k]) for k in sync)
    return out


def input_gradient_collectives(spans: list[Span]) -> list[tuple[Span, Span | None]]:
    """Each input-gradient collective (in a TP backward, every collective is one) and the wait for it, if the rank
    waited: the k-th wait with a tag is for the k-th collective with that tag. The collective's end is clipped to
    its wait's: its work was done when the wait returned (the completion stamp comes from a callback on gloo's
    thread, which can run late on a busy machine)."""
    collectives = [s for s in spans if s.lane not in ("compute", "wait") and _is_input_gradient(s.name)]
    waits = [s for s in spans if s.lane == "wait" and _is_input_gradient(s.name)]
    out, seen = [], defaultdict(int)
    for c in collectives:
        tagged = [w for w in waits if w.name == c.name]
        k, seen[c.name] = seen[c.name], seen[c.name] + 1
        w = tagged[k] if k < len(tagged) else None
        out.append((c._replace(end=min(c.end, w.end)) if w is not None else c, w))
    return out


def blocked_spans(spans: list[Span]) -> list[Span]:
    """When the rank was held by an input-gradient collective: inside the call that issued it (until the rank
    went on to a matmul or to the wait; gloo's call can take as long as the collective itself when the rank's
    threads outnumber its cores), and in its wait. Lane "wait", named after the collective."""
    starts = sorted(m.start for _, m in matmul_spans(spans))
    out = []
    for c, w in input_gradient_collectives(spans):
        returned = min([w.start if w is not None else c.end] + [t for t in starts if t >= c.start])
        out.append(Span("wait", c.name, c.start, max(c.start, returned)))
        if w is not None:
            out.append(w)
    return out


def matmul_spans(spans: list[Span]) -> list[tuple[str, Span]]:
    """(layer, span) for each column layer's announced backward matmul, in time order (a span the timeline cut in
    two, around a wait, is one span here)."""
    out = []
    for s in spans:
        if s.lane != "compute":
            continue
        for suffix in (" weight gradient", " input + weight gradients"):
            if s.name.endswith(suffix):
                layer = s.name[len("backward "): -len(suffix)]
                if out and out[-1][0] == layer and out[-1][1].name == s.name:
                    out[-1] = (layer, out[-1][1]._replace(end=s.end))
                else:
                    out.append((layer, s))
    return out


def overlap_order(spans: list[Span]) -> dict[str, str | None]:
    """Per column layer: the input-gradient collective that was on its way through the whole of the layer's
    backward matmul -- issued before the matmul started, waited for only after it ended -- or None."""
    pairs = input_gradient_collectives(spans)
    out = {}
    for layer, m in matmul_spans(spans):
        out[layer] = next((c.name for c, w in pairs if c.start <= m.start and (w.end if w else c.end) >= m.end),
                          None)
    return out


def overlap_stats(spans: list[Span], wall: float) -> dict:
    """One recorded backward: its wall time, the column layers' announced matmuls, the input gradients'
    collectives from issue to completion (their union), the time the rank was held by them (blocked_spans), and
    the share of their time during which it was not (hidden_fraction, the call counted as waiting)."""
    comm_spans = [c for c, _ in input_gradient_collectives(spans)] + blocked_spans(spans)
    return {"backward": wall, "matmuls": sum(m.end - m.start for _, m in matmul_spans(spans)),
            "all_reduce": lane_time(comm_spans, "all_reduce"), "blocked": lane_time(comm_spans, "wait"),
            "hidden": hidden_fraction(comm_spans)}


def overlap_results(config: GPTConfig = OVERLAP_CONFIG, b: int = OVERLAP_BATCH, reps: int = OVERLAP_REPS) -> dict:
    """Per path, rank 0's: the median of each of overlap_stats over the repetitions; the repetition of median
    backward time, to draw: its spans, its own overlap_stats ("drawn") and its overlap_order. The paths' gradients
    must be the same bits."""
    res = launch(overlap_measure, world_size=2, kwargs=dict(config=config, b=b, reps=reps), device="cpu")
    for rank, r in enumerate(res):
        if not r["grads_identical"]:
            raise AssertionError(f"rank {rank}: the synchronous and the async_grad_allreduce paths give different "
                                 f"gradients (largest difference {r['grad_diff']:.3g})")
    out = {}
    for path in PATHS:
        recorded = res[0][path]
        stats = [overlap_stats(r["spans"], r["wall"]) for r in recorded]
        median = sorted(range(len(recorded)), key=lambda k: stats[k]["backward"])[len(recorded) // 2]
        out[path] = {k: statistics.median(s[k] for s in stats) for k in stats[0]} | {
            "spans": recorded[median]["spans"], "drawn": stats[median],
            "order": overlap_order(recorded[median]["spans"]), "reps": len(recorded)}
    return out


def overlap_table(results: dict, config: GPTConfig = OVERLAP_CONFIG, b: int = OVERLAP_BATCH) -> str:
    n = b * config.block_size
    reps = next(iter(results.values()))["reps"]
    head = (f"**The input gradient's all-reduce behind the weight gradient**: t = 2 CPU ranks over gloo, TinyGPT "
            f"({config.n_layer} blocks, h = {config.n_embd}, {config.n_head} heads, vocabulary {config.vocab_size}), "
            f"b = {b}, s = {config.block_size} ({n:,} tokens), fp32; one backward on rank 0, the median of {reps} "
            f"after one to warm up. Each of the {2 * config.n_layer + 1} column layers (each block's qkv and fc, the "
            f"tied head) all-reduces an input gradient of {fmt_bytes(n * config.n_embd * 4)}. Column-layer matmuls: "
            f"the async path's weight-gradient matmuls; on the synchronous path, the autograd nodes that compute "
            f"dL/dx and dL/dW together. All-reduces: from issue to completion. Blocked: inside an all-reduce's call "
            f"or its wait. Hidden: the share of the all-reduces' time during which the rank was not blocked "
            f"(hidden_fraction). Both paths give the same gradients, bit for bit (checked).\n\n"
            "| path | backward | column-layer matmuls | input-gradient all-reduces | blocked | hidden |\n"
            "|---|---|---|---|---|---|\n")
    lines = [f"| {path} | {r['backward'] * 1e3:.1f} ms | {r['matmuls'] * 1e3:.1f} ms | "
             f"{r['all_reduce'] * 1e3:.1f} ms | {r['blocked'] * 1e3:.1f} ms | {100 * r['hidden']:.0f}% |"
             for path, r in results.items()]
    return head + "\n".join(lines) + "\n"


def _short(layer: str) -> str:
    """"blocks.1.attn.qkv" -> "qkv 1", "blocks.0.fc" -> "fc 0", "lm_head" -> "head"."""
    if layer == "lm_head":
        return "head"
    parts = layer.split(".")
    return f"{parts[-1]} {parts[1]}" if parts[0] == "blocks" else layer


@style.charts
def plot_overlap(results: dict, path: str) -> None:
    """The two paths' backward of median time, one above the other on one time axis (rank 0): a compute row (the
    column layers' matmuls labelled with their layer, the rest of backward grey, the time held by an all-reduce
    hatched) and a row for the input gradients' all-reduces, each labelled with its layer."""
    from matplotlib.patches import Patch

    other, matmul, reduce_ = style.FILLS["grey"], style.FILLS["orange"], style.FILLS["purple"]
    fig, axes = style.figure(5.0, len(PATHS), 1, sharex=True, squeeze=False)
    axes = axes[:, 0]
    longest = max(max(s.end for s in results[p]["spans"]) - min(s.start for s in results[p]["spans"]) for p in PATHS)
    for ax, name in zip(axes, PATHS):
        r = results[name]["drawn"]
        spans = results[name]["spans"]
        matmuls = matmul_spans(spans)
        origin = min(s.start for s in spans)

        def ms(s, origin=origin):
            return (s.start - origin) * 1e3, (s.end - s.start) * 1e3

        for s in spans:
            if s.lane == "compute":
                color = matmul if s.name.endswith(("weight gradient", "weight gradients")) else other
                ax.broken_barh([ms(s)], (1.4, 0.8), facecolors=color, edgecolor="none")
        for s in blocked_spans(spans):  # (over the compute row: the timeline's "backward" runs on through a call)
            ax.broken_barh([ms(s)], (1.4, 0.8), facecolors=other, edgecolor=style.MUTED, hatch="////", linewidth=0.5)
        for layer, m in matmuls:  # the layer's name above its matmul
            left, width = ms(m)
            ax.text(left + width / 2, 2.25, _short(layer), ha="center", va="bottom", fontsize=10)
        reduces = [c for c, _ in input_gradient_collectives(spans)]
        for k, s in enumerate(reduces):  # ... and below its input gradient's all-reduce
            left, width = ms(s)
            ax.broken_barh([(left, width)], (0.5, 0.8), facecolors=reduce_, edgecolor="none")
            # the k-th all-reduce is the k-th column layer's input gradient (both paths go layer by layer)
            label = _short(matmuls[k][0]) if k < len(matmuls) else ""
            ax.text(left + width / 2, 0.45, label, ha="center", va="top", fontsize=10, color=style.LINES["purple"])
        ax.set_yticks([0.9, 1.8], ["all-reduce", "compute"])
        ax.tick_params(axis="y", length=0)
        ax.set_ylim(-0.2, 2.8)
        ax.set_xlim(0, longest * 1e3 * 1.01)
        ax.set_title(f"{name}: backward {r['backward'] * 1e3:.0f} ms, {100 * r['hidden']:.0f}% of the input-gradient "
                     f"all-reduces hidden", fontsize=10, loc="left")
    axes[-1].set_xlabel("ms since backward began (rank 0 of t = 2 CPU ranks over gloo)")
    handles = [Patch(color=matmul, label="column layer's matmuls: dL/dx + dL/dW (sync), dL/dW (async)"),
               Patch(color=other, label="rest of backward"),
               Patch(color=reduce_, label="the input gradient's all-reduce"),
               Patch(facecolor=other, edgecolor=style.MUTED, hatch="////", label="in the all-reduce's call or wait")]
    fig.legend(handles=handles, loc="outside lower center", ncol=1)
    style.save(fig, path)

