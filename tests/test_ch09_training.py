"""Chapter 9 (part): gradient accumulation with and without no_sync(), clipping on sharded gradients, for
FSDP and for the strategies of chapters 1, 3 and 4; activation checkpointing composed with FSDP; deferred
initialisation on the meta device.

References: torch's DDP (with its own no_sync and torch.nn.utils.clip_grad_norm_) and one process on the
global batch. Tolerances:
- FSDP's no_sync against DDP's no_sync: both add the micro-batch gradients locally in the same order and
  average once, so bit-exact at N = 1, 2; at N = 3, 4 the reduce-scatter adds the ranks in another order
  than the all-reduce: 1e-6 (as in chapter 6).
- Reducing every micro-batch against DDP's no_sync: the average of sums vs the sum of averages rounds
  differently at any N: 1e-6.
- Against one process on the whole batch: every addition in another order: 1e-5.
- Clipping: the global norm is summed from per-shard partial sums, not per-tensor norms: 1e-5 relative on
  the norm, 1e-6 on the parameters (SGD, whose step scales with the clipped gradient).

Steps: two optimizer steps of three micro-batches each (two inside no_sync, the first making the unsharded
gradient and the second adding to it, then one that reduces); three clipped steps; two with checkpointed
blocks and two after deferred initialisation. From the second step on the optimizers step on their state
and a backward follows a zero_grad, which is what a further step would repeat.

FSDP accumulates with both optimizers; our DDP, OSS, SDP and the flat ZeRO-2 each with one, in turn: what
they must get right is the gradient the optimizer is handed after the last micro-batch, compared through the
parameters it produces. The optimizer runs once, after accumulating, and is not what no_sync changes.
What checkpointing frees is measured at 2 and 3 ranks (sharded, evenly and not): a rank's activations
depend on its slice of the batch, not on how many other ranks there are, and the values it leaves
unchanged are checked at every world size.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from minifsdp import MemoryMeter, comm, launch
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.fsdp import ModuleWrapPolicy
from minifsdp.fsdp.checkpointing import checkpoint_module
from minifsdp.models import Block, GPTConfig, TinyGPT, init_weights
from minifsdp.reports.options import CONFIG, checkpointing
from minifsdp.state_dict import get_full_state_dict
from minifsdp.train import OPTIMIZERS, STRATEGIES, batch, build_model, loss_of, max_abs_diff
from minifsdp.zero.clip import clip_sharded_grad_norm_
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 3, 4)
MICRO, STEPS = 3, 2
CLIP_STEPS = 3
EXACT = {1: 0.0, 2: 0.0, 3: 1e-6, 4: 1e-6}


STRATEGY_OF = {"ddp": "torch_ddp", "ours_ddp": "ddp", "oss": "oss", "sdp": "sdp", "sdp_flat": "sdp_flat"}
# the other strategies' accumulation: (kind, optimizer), one optimizer each (see above)
OTHER_ACCUMULATE = [("ours_ddp", "sgd"), ("oss", "adamw"), ("sdp", "sgd"), ("sdp_flat", "adamw")]


def _build(kind, net, optimizer):
    """(model, optimizer): torch's DDP, or one of minifsdp's strategies (our FSDP without prefetching)."""
    if kind.startswith("fsdp"):
        model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}))
        return model, OPTIMIZERS[optimizer](model.parameters())
    return STRATEGIES[STRATEGY_OF[kind]].build(net, optimizer, False)


def _params(kind, model, net):
    return get_full_state_dict(model) if kind.startswith("fsdp") else {k: v.detach().clone() for k, v in net.state_dict().items()}


def accumulate(kind, optimizer):
    """STEPS optimizer steps of MICRO micro-batches each; the loss of each is divided by MICRO."""
    n, r = dist.get_world_size(), dist.get_rank()
    net = build_model("gpt", seed=r)
    model, opt = _build(kind, net, optimizer)
    for step in range(STEPS):
        for m in range(MICRO):
            quiet = kind != "fsdp_sync_each" and m < MICRO - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                (loss_of("gpt", model, batch("gpt", step * MICRO + m, 12, r, n, "cpu")) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return _params(kind, model, net)


def single_process(optimizer):
    net = build_model("gpt", seed=0)
    opt = OPTIMIZERS[optimizer](net.parameters())
    for step in range(STEPS):
        for m in range(MICRO):
            (loss_of("gpt", net, batch("gpt", step * MICRO + m, 12, 0, 1, "cpu")) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


MAX_NORM = {2.0: 0.5, float("inf"): 0.02}  # below every step's norm (the test checks), so clipping acts


def clipped(kind, norm_type):
    max_norm = MAX_NORM[norm_type]
    n, r = dist.get_world_size(), dist.get_rank()
    net = build_model("gpt", seed=r)
    model, opt = _build(kind, net, "sgd")
    norms, sent = [], []
    for step in range(CLIP_STEPS):
        loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
        with comm.counting() as counter:
            if kind == "fsdp":
                norms.append(float(model.clip_grad_norm_(max_norm, norm_type)))
            elif kind in ("oss", "sdp"):  # the sharded optimizer knows who owns what
                norms.append(float(opt.clip_grad_norm_(max_norm, norm_type)))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        sent.append((dict(counter.calls), dict(counter.bytes)))
        opt.step()
        opt.zero_grad()
    return _params(kind, model, net), norms, sent


# -- the norm from the shards, for any p (exercise 9.2's contract, apart from any strategy) --------------------------
NORM_TYPES = (0.5, 1.0, 2.0, 3.0, float("inf"))


def whole_gradient(zero=False):
    """The same 1,000 elements on every rank, the largest |g_i| near the end (on the last rank of most cuts)."""
    g = torch.randn(1000, generator=torch.Generator().manual_seed(9))
    g[997] = -7.5
    return torch.zeros(1000) if zero else g


def cut(g, how, n, r):
    """Rank r's slices of g, cut across n ranks in one of several ways: the function must not care how."""
    if how in ("even shards", "zeros"):  # FSDP: one flat shard each, the padding zero
        shard = -(-g.numel() // n)
        return [torch.cat([g, g.new_zeros(shard * n - g.numel())])[r * shard: (r + 1) * shard].clone()]
    tensors = [g[:300].view(20, 15), g[300:500].view(10, 20), g[500:750].view(25, 10), g[750:]]
    if how == "whole tensors":  # OSS, SDP: each rank the gradients of the parameters it owns
        return [t.clone() for i, t in enumerate(tensors) if i % n == r]
    if how == "all on the last rank":  # the others hold nothing at all
        return [t.clone() for t in tensors] if r == n - 1 else []
    bounds = [0, 1, 50, 51, 400, 999, 1000]  # "uneven pieces": 1 to 6 pieces a rank, of 1 to 349 elements
    pieces = [g[a:b] for a, b in zip(bounds, bounds[1:])]
    return [t.clone() for i, t in enumerate(pieces) if i * n // len(pieces) == r]


CUTS = ("even shards", "whole tensors", "all on the last rank", "uneven pieces", "zeros")


def sharded_norms():
    """clip_sharded_grad_norm_ called on each cut, for each p: what it returned (nothing to clip: max_norm is
    far above every norm), what crossed `comm`, and the whole gradient's norm, in fp64."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for how in CUTS:
        g = whole_gradient(zero=how == "zeros")
        for p in NORM_TYPES:
            grads = cut(g, how, n, r)
            with comm.counting() as counter:
                total = clip_sharded_grad_norm_(grads, 1e9, p)
            out[how, p] = {"total": total.detach().clone(), "want": float(torch.linalg.vector_norm(g.double(), p)),
                           "tensors": len(grads), "sent": (dict(counter.calls), dict(counter.bytes))}
    return out


def no_sync_memory():
    """Live bytes a no_sync backward leaves behind (the unsharded gradients), and a synced one after it."""
    n, r = dist.get_world_size(), dist.get_rank()
    model = FSDP(build_model("gpt", seed=0), auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = OPTIMIZERS["adamw"](model.parameters())
    loss_of("gpt", model, batch("gpt", 0, 12, r, n, "cpu")).backward()
    opt.step()
    opt.zero_grad()
    meter = MemoryMeter(model, opt)
    flats = [f for u in model.units() for f in u.flat_params]
    with meter:
        base = meter.live()["total"]
        with model.no_sync(), comm.counting() as inside:
            loss_of("gpt", model, batch("gpt", 1, 12, r, n, "cpu")).backward()
        kept = meter.live()["total"] - base
        # what each unit holds now: its whole flat gradient (padded), in its own tensor; its .grad: nothing new
        held = [(tuple(f.unsharded_grad.shape), f.unsharded_grad.dtype == f.param.dtype, f.param.grad is None)
                if f.unsharded_grad is not None else None for f in flats]
        with comm.counting() as synced:
            loss_of("gpt", model, batch("gpt", 2, 12, r, n, "cpu")).backward()
        after = meter.live()["total"] - base
    meter.close()
    return {"kept": kept, "after": after, "padded": sum(f.shard_numel * n for f in flats),
            "left": sum(f.unsharded_grad is not None for f in flats), "held": held,
            "full": [(f.shard_numel * n,) for f in flats], "inside": dict(inside.calls),
            "synced": dict(synced.calls)}


# -- activation checkpointing ------------------------------------------------------------------------------
DEEP = CONFIG  # four blocks, as in the report of minifsdp/options.py
CKPT_MEMORY_WORLD_SIZES = (2, 3)  # see the module's docstring


def checkpointed(order, reentrant=False, kind="fsdp"):
    """Two SGD steps with checkpointed blocks: FSDP(checkpoint(block)), checkpoint(FSDP(block)), or none;
    the parameters, and the collectives of the last step."""
    n, r = dist.get_world_size(), dist.get_rank()
    net = build_model("gpt", seed=r)
    if order == "fsdp(ckpt)":
        for block in net.blocks:
            checkpoint_module(block, use_reentrant=reentrant)
    model, opt = _build(kind, net, "sgd")
    if order == "ckpt(fsdp)":
        for unit in model.units()[1:]:
            checkpoint_module(unit, use_reentrant=reentrant)
    for step in range(2):
        with comm.counting() as counter:
            loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    return _params(kind, model, net), dict(counter.calls)


def one_blocks_activations():
    """What one block's forward leaves alive for its backward, and its output (measured on its own)."""
    n = dist.get_world_size()
    torch.manual_seed(0)
    block = Block(DEEP)
    x = torch.randn(12 // n, DEEP.block_size, DEEP.n_embd, requires_grad=True)
    meter = MemoryMeter(block)
    with meter:
        before = meter.live()["total"]
        y = block(x)
        kept = meter.live()["total"] - before
    return {"kept": kept, "output": y.numel() * y.element_size()}


# -- deferred initialisation ----------------------------------------------------------------------------------
DEFERRED = GPTConfig(n_layer=8)


def deferred_init():
    """The same GPT built eagerly and on the meta device (each rank with its own seed: sync_module_states
    must make rank 0's the truth), equal before and after training; the memory deferred init needed."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for how in ("eager", "deferred"):
        if how == "eager":
            net = TinyGPT(DEFERRED, seed=r)
        else:
            with torch.device("meta"):
                net = TinyGPT(DEFERRED, seed=r)
        meter = MemoryMeter()
        with meter:
            model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}),
                         param_init_fn=init_weights if how == "deferred" else None)
        built = model.full_state_dict()
        opt = OPTIMIZERS["adamw"](model.parameters())
        for step in range(2):
            loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu", DEFERRED)).backward()
            opt.step()
            opt.zero_grad()
        units = [(4 * sum(f.numel for f in u.flat_params), 4 * sum(f.shard_numel for f in u.flat_params) * n,
                  4 * sum(f.shard_numel for f in u.flat_params)) for u in model.units()]
        out[how] = {"built": built, "trained": model.full_state_dict(), "peak": meter.peak, "units": units}
    with torch.device("meta"):  # no param_init_fn: each module's reset_parameters(), torch's own init
        plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))
    out["reset_parameters"] = FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear})).full_state_dict()
    return out


def chapter_cases():
    out = {}
    for opt in ("sgd", "adamw"):
        for kind in ("ddp", "fsdp", "fsdp_sync_each") + tuple(k for k, o in OTHER_ACCUMULATE if o == opt):
            out[("accumulate", kind, opt)] = accumulate(kind, opt)
        if dist.get_rank() == 0:
            out[("single", opt)] = single_process(opt)
    for norm_type in (2.0, float("inf")):
        for kind in ("ddp", "fsdp", "oss", "sdp"):
            out[("clip", kind, norm_type)] = clipped(kind, norm_type)
    out["norms"] = sharded_norms()
    out["memory"] = no_sync_memory()
    for order, reentrant in [("none", False), ("fsdp(ckpt)", False), ("fsdp(ckpt)", True), ("ckpt(fsdp)", False),
                             ("ckpt(fsdp)", True)]:
        out[("ckpt", order, reentrant)] = checkpointed(order, reentrant)
    for order in ("none", "fsdp(ckpt)"):  # DDP: the checkpoint needs no help from the strategy
        out[("ckpt_ddp", order)] = checkpointed(order, kind="ours_ddp")
    if dist.get_world_size() in CKPT_MEMORY_WORLD_SIZES:
        out["ckpt_memory"] = checkpointing()  # the report's own measurement (python -m minifsdp options)
        out["block"] = one_blocks_activations()
    out["deferred"] = deferred_init()
    return out


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda n: launch(chapter_cases, world_size=n, device="cpu"), WORLD_SIZES)


@pytest.mark.exercise("9.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_no_sync_accumulation_equals_ddps(ranks, n, opt):
    for r in range(n):
        ours, ddp = ranks[n][r][("accumulate", "fsdp", opt)], ranks[n][r][("accumulate", "ddp", opt)]
        diff = max_abs_diff(ours, ddp)
        assert diff <= EXACT[n], (
            f"N = {n}, rank {r}, {opt}: after {STEPS} steps of {MICRO} micro-batches, FSDP with no_sync() is {diff:.3g} "
            f"from torch's DDP with its no_sync(), expected at most {EXACT[n]:g} (exercise 9.1): is every "
            f"micro-batch's full gradient added to what was kept, and is the sum added in before the one "
            f"reduce-scatter? Reducing each micro-batch and adding the shards rounds differently.")


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("kind, opt", OTHER_ACCUMULATE)
def test_no_sync_accumulation_of_the_other_strategies(ranks, n, opt, kind):
    """Our DDP and OSS on it add locally and all-reduce once, as torch's DDP: bit-exact. SDP reduces each
    bucket to its owner and the flat ZeRO-2 reduce-scatters: other orders of addition at N >= 3."""
    tolerance = 0.0 if kind in ("ours_ddp", "oss") else EXACT[n]
    for r in range(n):
        ours, ddp = ranks[n][r][("accumulate", kind, opt)], ranks[n][r][("accumulate", "ddp", opt)]
        assert max_abs_diff(ours, ddp) <= tolerance


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_reducing_every_micro_batch_equals_it_too(ranks, n, opt):
    for r in range(n):
        each, ddp = ranks[n][r][("accumulate", "fsdp_sync_each", opt)], ranks[n][r][("accumulate", "ddp", opt)]
        assert max_abs_diff(each, ddp) <= 1e-6


@pytest.mark.exercise("9.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_accumulation_equals_one_process_on_the_whole_batch(ranks, n, opt):
    single = ranks[n][0][("single", opt)]
    for kind in ("fsdp", "fsdp_sync_each", "ddp"):
        diff = max_abs_diff(ranks[n][0][("accumulate", kind, opt)], single)
        assert diff <= 1e-5, (
            f"N = {n}, {opt}: {kind} after {STEPS} steps of {MICRO} micro-batches is {diff:.3g} from one process on "
            f"the whole batch, expected at most 1e-5 (exercise 9.1): does a backward inside no_sync() add to the "
            f"kept gradient rather than replace it, and does the next one outside fold it in?")


@pytest.mark.exercise("9.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
@pytest.mark.parametrize("kind", ["fsdp", "oss", "sdp"])
def test_clipping_sharded_gradients_equals_clipping_full_ones(ranks, n, norm_type, kind):
    for r in range(n):
        (ours, our_norms, _), (ddp, ddp_norms, _) = (ranks[n][r][("clip", k, norm_type)] for k in (kind, "ddp"))
        assert all(d > MAX_NORM[norm_type] for d in ddp_norms), "max_norm must be below the norms, or nothing is clipped"
        assert our_norms == pytest.approx(ddp_norms, rel=1e-5), (
            f"N = {n}, rank {r}, {kind}, p = {norm_type:g}: the norms of {CLIP_STEPS} steps were "
            f"{', '.join(f'{x:.6g}' for x in our_norms)}, torch's clip_grad_norm_ on the full gradients "
            f"{', '.join(f'{x:.6g}' for x in ddp_norms)} (exercise 9.2): is it the norm of this rank's slices "
            f"alone, or the ranks' norms added up? For p = inf, the largest |g_i| of any rank.")
        diff = max_abs_diff(ours, ddp)
        assert diff <= 1e-6, (
            f"N = {n}, rank {r}, {kind}, p = {norm_type:g}: after {CLIP_STEPS} clipped SGD steps the parameters are "
            f"{diff:.3g} from torch's DDP, expected at most 1e-6 (exercise 9.2): does every rank return the same norm, "
            f"so that every slice is scaled by the same coefficient?")


@pytest.mark.mechanism
@pytest.mark.exercise("9.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
@pytest.mark.parametrize("kind", ["fsdp", "oss", "sdp"])
def test_clipping_sends_one_number(ranks, n, norm_type, kind):
    """Each clip: one all-reduce of one fp32 number (each rank's partial sum, or its max), through comm --
    2 x 4 (N-1)/N bytes -- however many gradients the rank holds, and nothing else."""
    one = ({"all_reduce": 1}, {"all_reduce": 2 * 4 * (n - 1) / n})
    for r in range(n):
        _, _, sent = ranks[n][r][("clip", kind, norm_type)]
        for step, (calls, sent_bytes) in enumerate(sent):
            assert (calls, sent_bytes) == one, (
                f"N = {n}, rank {r}, {kind}, p = {norm_type:g}: clip {step + 1} issued {calls or 'nothing'} through "
                f"comm, sending {_bytes(sent_bytes)}, expected one all_reduce of one fp32 number, "
                f"{_bytes(one[1])} (exercise 9.2): does each rank send its gradients, a number per gradient, or "
                f"gather every rank's number, rather than reduce one number that stands for its whole slice?")


@pytest.mark.exercise("9.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_norm_is_the_whole_gradients_however_it_is_cut(ranks, n):
    """For any p > 0 and p = inf, however the gradient is cut into slices (one flat shard a rank, whole tensors
    of several shapes, uneven pieces, everything on one rank and nothing on the others), every rank returns
    the norm of the whole gradient, as one 0-dim tensor, the same on every rank to the last bit."""
    for how in CUTS:
        for p in NORM_TYPES:
            first = ranks[n][0]["norms"][how, p]["total"]
            for r in range(n):
                res = ranks[n][r]["norms"][how, p]
                total, want = res["total"], res["want"]
                assert isinstance(total, torch.Tensor) and total.dim() == 0, (
                    f"N = {n}, rank {r}, p = {p:g}: the norm is {total!r}, expected a 0-dim tensor (exercise 9.2)")
                assert float(total) == pytest.approx(want, rel=1e-5), (
                    f"N = {n}, rank {r}, p = {p:g}, the gradient cut as '{how}' ({res['tensors']} tensors on this "
                    f"rank): the norm is {float(total):.7g}, the whole gradient's is {want:.7g} (exercise 9.2): is it "
                    f"the norm of this rank's slices alone, the ranks' norms added up, or the 1/p power taken before "
                    f"the ranks' parts are combined? A rank that holds nothing still takes part.")
                assert torch.equal(total, first), (
                    f"N = {n}, p = {p:g}, cut as '{how}': rank {r}'s norm is {float(total)!r}, rank 0's "
                    f"{float(first)!r} (exercise 9.2): every rank must compute the same number, bit for bit, or the "
                    f"ranks scale their slices by different coefficients")


@pytest.mark.mechanism
@pytest.mark.exercise("9.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_norm_sends_one_number_however_the_gradient_is_cut(ranks, n):
    """One all-reduce of one fp32 number through comm, 2 x 4 (N-1)/N bytes, for every p and whether the rank
    holds one tensor, several, or none."""
    one = ({"all_reduce": 1}, {"all_reduce": 2 * 4 * (n - 1) / n})
    for how in CUTS:
        for p in NORM_TYPES:
            for r in range(n):
                res = ranks[n][r]["norms"][how, p]
                calls, sent_bytes = res["sent"]
                assert (calls, sent_bytes) == one, (
                    f"N = {n}, rank {r}, p = {p:g}, the gradient cut as '{how}' ({res['tensors']} tensors on this "
                    f"rank): the norm issued {calls or 'nothing'} through comm, sending {_bytes(sent_bytes)}, "
                    f"expected one all_reduce of one fp32 number, {_bytes(one[1])} (exercise 9.2): one reduction of "
                    f"one number, not a gather of every rank's number or of the gradients: which number can each "
                    f"rank send, whatever it holds, so that one reduction gives every rank the whole norm?")


def _bytes(sent: dict) -> str:
    return ", ".join(f"{kind} {b:,.0f} B" for kind, b in sent.items()) or "0 B"


@pytest.mark.mechanism
@pytest.mark.exercise("9.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_no_sync_sends_nothing_and_keeps_each_units_full_gradient(ranks, n):
    """Inside no_sync() backward all-gathers the parameters as ever, and reduces nothing: no reduce-scatter, no
    all-reduce. Every unit keeps its whole (padded) flat gradient, in its dtype, off .grad; the next backward
    reduce-scatters each unit once."""
    for r in range(n):
        m = ranks[n][r]["memory"]
        assert set(m["inside"]) == {"all_gather"}, (
            f"N = {n}, rank {r}: a backward inside no_sync() issued {m['inside']}, expected all-gathers only "
            f"(exercise 9.1): inside the block nothing is reduced; each unit keeps its gradient and returns True, "
            f"so that the runtime sends nothing")
        for i, (held, full) in enumerate(zip(m["held"], m["full"])):
            assert held == (full, True, True), (
                f"N = {n}, rank {r}: after a backward inside no_sync(), flat parameter {i} keeps "
                f"{'nothing' if held is None else f'a tensor of shape {held[0]} (dtype kept: {held[1]}, .grad None: {held[2]})'} "
                f"in unsharded_grad, expected its whole padded flat gradient, shape {full}, in its own dtype, with "
                f".grad None (exercise 9.1): is the full gradient taken off .grad and kept whole, not its shard?")
        units, calls = len(m["full"]), m["synced"]
        assert calls.get("reduce_scatter") == units and "all_reduce" not in calls, (
            f"N = {n}, rank {r}: the first backward after no_sync() issued {calls}, expected one reduce_scatter per "
            f"flat parameter, {units}, and no all_reduce (exercise 9.1): outside the block, the kept sum is added "
            f"into the new full gradient and sent once")


@pytest.mark.mechanism
@pytest.mark.exercise("9.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_no_sync_keeps_the_unsharded_gradients_and_the_next_backward_drops_them(ranks, n):
    m = ranks[n][0]["memory"]
    assert m["kept"] == 4 * m["padded"], (  # every unit's full flat gradient: 4Ψ (padded)
        f"N = {n}: a backward inside no_sync() left {m['kept']:,} B more alive, expected every unit's padded flat "
        f"gradient, {4 * m['padded']:,} B (exercise 9.1): "
        + ("is only the shard kept, or nothing?" if m["kept"] < 4 * m["padded"] else
           "is the gradient kept twice, once in unsharded_grad and once in .grad, or its shard kept beside it?"))
    assert m["left"] == 0, (
        f"N = {n}: after the next backward outside no_sync(), {m['left']} flat parameters still keep an unsharded "
        f"gradient, expected none (exercise 9.1): once the kept sum is added in, let it go")
    assert m["after"] < m["kept"] or n == 1, (  # at N = 1 a shard is the whole
        f"N = {n}: after the next backward outside no_sync(), {m['after']:,} B more are alive than before, not less "
        f"than the {m['kept']:,} B held inside (exercise 9.1): the kept full gradients must go once reduced")


def test_clip_grad_norm_is_for_the_root():
    with pytest.raises(Exception, match="call it on the root unit"):
        launch(_clip_on_a_nested_unit, world_size=1, device="cpu")


def _clip_on_a_nested_unit():
    model = FSDP(build_model("gpt", seed=0), auto_wrap_policy=ModuleWrapPolicy({Block}))
    model.units()[1].clip_grad_norm_(1.0)


# -- activation checkpointing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("order,reentrant,extra", [("fsdp(ckpt)", False, 0), ("fsdp(ckpt)", True, 0),
                                                   ("ckpt(fsdp)", False, 0), ("ckpt(fsdp)", True, 1)],
                         ids=["FSDP(ckpt)", "FSDP(ckpt)-reentrant", "ckpt(FSDP)", "ckpt(FSDP)-reentrant"])
def test_checkpointing_changes_no_value_and_costs_what_it_should(ranks, n, order, reentrant, extra):
    """Bit-exact: the recomputed forward is the same computation. Communication: the same, except that
    reentrant checkpoint(FSDP(block)) all-gathers each block once more (see minifsdp/checkpointing.py)."""
    blocks = GPTConfig().n_layer
    for r in range(n):
        (params, calls), (plain, plain_calls) = ranks[n][r][("ckpt", order, reentrant)], ranks[n][r][("ckpt", "none", False)]
        assert max_abs_diff(params, plain) == 0.0
        assert calls["all_gather"] == plain_calls["all_gather"] + extra * blocks
        assert calls["reduce_scatter"] == plain_calls["reduce_scatter"]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_checkpointing_under_ddp_changes_no_value(ranks, n):
    for r in range(n):
        assert max_abs_diff(ranks[n][r][("ckpt_ddp", "fsdp(ckpt)")][0], ranks[n][r][("ckpt_ddp", "none")][0]) == 0.0


@pytest.mark.parametrize("n", CKPT_MEMORY_WORLD_SIZES)
def test_checkpointing_frees_the_blocks_activations(ranks, n):
    """After forward, exactly each block's activations are gone (all but its output, which the next block
    or the checkpoint keeps as its input), as measured on one block alone. The peak falls by less: backward
    recomputes one block at a time, and the peak need not come where every block's activations are alive."""
    plain, ckpt = (ranks[n][0]["ckpt_memory"][k] for k in ("none", "FSDP(checkpoint(block))"))
    block = ranks[n][0]["block"]
    per_block = block["kept"] - block["output"]
    assert plain["kept"] - ckpt["kept"] == DEEP.n_layer * per_block
    assert 0 < plain["peak"] - ckpt["peak"] <= DEEP.n_layer * per_block


# -- deferred initialisation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_meta_device_init_equals_eager_init(ranks, n):
    """Bit-exact, because every tensor's init draws from a generator seeded by (seed, module name), not
    from torch's global one: the order units are initialised in does not matter (minifsdp/models.py)."""
    for r in range(n):
        eager, deferred = ranks[n][r]["deferred"]["eager"], ranks[n][r]["deferred"]["deferred"]
        assert max_abs_diff(deferred["built"], eager["built"]) == 0.0
        assert max_abs_diff(deferred["trained"], eager["trained"]) == 0.0
        assert max_abs_diff(deferred["built"], ranks[n][0]["deferred"]["deferred"]["built"]) == 0.0


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_deferred_init_holds_one_unit_in_full_at_a_time(ranks, n):
    """Units are built innermost first; while unit k is built, a rank holds the shards of the units before
    it, unit k's parameters, its padded flat copy, and its shard: the peak is the largest such sum, exactly."""
    d = ranks[n][0]["deferred"]["deferred"]
    model, done = 0, 0
    for params, padded, shard in d["units"][1:] + d["units"][:1]:  # blocks, then the root (listed first)
        model = max(model, done + params + padded + shard)
        done += shard
    assert d["peak"] == model
    psi_bytes = sum(params for params, _, _ in d["units"])
    if n == 4:
        assert d["peak"] < psi_bytes / 2  # a model twice one rank's memory could be built


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_deferred_init_defaults_to_reset_parameters_and_agrees_across_ranks(ranks, n):
    sd = ranks[n][0]["deferred"]["reset_parameters"]
    assert all(torch.isfinite(v).all() for v in sd.values()) and sd["1.weight"].eq(1).all()
    for r in range(n):
        assert max_abs_diff(ranks[n][r]["deferred"]["reset_parameters"], sd) == 0.0
