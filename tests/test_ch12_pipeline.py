"""Chapter 12: pipeline parallelism -- the schedules' orders, their numerics against one process on the whole batch
and against torch.distributed.pipelining, their bubbles, the micro-batches they hold, and the bytes they send.

A TinyGPT of 8 blocks (n_embd 16, sequence 8, vocabulary 96, the tied embedding) is cut into p stages (p*v with
v = 2 virtual stages for the interleaved schedule), a batch of 16 into m micro-batches. One launch per world
size (2 and 4) runs every case; the orders and the ideal machine (simulate) need no ranks at all.

Tolerances, and why:
- Against one process on the whole batch (fp32; SGD with momentum and AdamW, 2 steps): the gradients of every
  step within 1e-6, the losses and the parameters after each step within 1e-6 (SGD) and 1e-5 (AdamW). With
  m = 1 the pipeline computes the very operations of the single process and gets the same bits (measured 0.0,
  the tied embedding included: its two halves are summed across the two ranks, and a + b is b + a). With m > 1
  each weight gradient is a sum of m micro-batch gradients added one after the other instead of one matmul
  over the whole batch: another summation order. Measured at most 3.0e-8 in the gradients; 3.7e-9 in the
  parameters with SGD, 7.9e-7 with AdamW, whose first steps are about lr * sign(g): where a gradient element
  is within a few ulps of eps, an ulp of it moves the step by a visible part of lr = 3e-3 (the losses: up to
  4.8e-7, after an AdamW step).
- Against torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B (the same
  stage modules, untied, as torch's schedules know nothing of ties): 0.0 -- the same operations, each stage's
  micro-batch gradients accumulated in the same order.
- The bubble, with every forward lasting 50 ms and every backward 100 ms (25 and 50 ms for the interleaved
  schedule's half-size stages): within 0.05 (absolute) of (p - 1)/(v*m + p - 1) on every rank. Measured
  0.206 / 0.207 / 0.127 against 0.200 / 0.200 / 0.111 at p = 2, m = 4 (GPipe / 1F1B / interleaved) and
  0.280 / 0.286 / 0.169 against 0.273 / 0.273 / 0.158 at p = 4, m = 8: always a little more, the messages'
  latency (about 0.2 - 2 ms a hop here, 4 ranks sharing 2 cores) added to every hop of the critical path,
  twice as many hops for the interleaved schedule. On the ideal machine (simulate) the formula holds exactly,
  for every order here, with t_b = 2 t_f.
- Bytes sent: exact. Micro-batches in flight: exactly m for GPipe, at most the budget for 1F1B and the
  interleaved schedule (min(p - r, m); Megatron's count). Activation memory (the meter's "other"
  bytes at their peak, m = 8): GPipe above 1F1B on every rank -- measured 556,736 vs 147,776 and 617,568 vs
  96,040 bytes at p = 2; 288,448 / 286,784 / 286,784 / 349,280 vs 149,952 / 119,104 / 85,568 / 62,504 at
  p = 4, where 1F1B's shrink from rank to rank as its p - r micro-batches in flight do.
"""

import pytest
import torch
from torch import nn

from minifsdp import launch
from minifsdp.distributed import comm
from minifsdp.measure.pipeline_timeline import (bubble_formula, bubble_fractions, in_flight_peak, in_flight_peaks,
                                                pipeline_actions, plot_pipeline, simulate)
from minifsdp.models import GPTConfig, TinyGPT, gpt_batch
from minifsdp.parallel.pipeline import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from minifsdp.parallel.pipeline_orders import (BACKWARD, FORWARD, Action, gpipe_order, interleaved_order,
                                               one_f_one_b_order, stages_of_rank)
from minifsdp.parallel.pipeline_stage import PipelineStage, gpt_loss, split_gpt
from minifsdp.train import OPTIMIZERS

CONFIG = GPTConfig(n_layer=8, n_embd=16, n_head=2, block_size=8, vocab_size=96)
BATCH, STEPS = 16, 2
GRAD_ATOL = 1e-6
ATOL = {"sgd": 1e-6, "adamw": 1e-5}  # the parameters and losses (AdamW magnifies an ulp: see above)
BUBBLE_ATOL = 0.05
COMPUTE_TIME = (0.050, 0.100)  # seconds a forward, a backward of a stage (halved for interleaved stages)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
V = {"gpipe": 1, "1f1b": 1, "interleaved": 2}

# (schedule, m, optimizer) per pipeline size p; the interleaved schedule needs m divisible by p
PARITY = {2: [(s, m, opt) for s in ("gpipe", "1f1b") for m, opt in ((1, "sgd"), (4, "adamw"), (8, "sgd"))]
          + [("interleaved", 2, "adamw"), ("interleaved", 4, "sgd"), ("interleaved", 8, "adamw")],
          4: [("gpipe", 4, "sgd"), ("gpipe", 8, "adamw"), ("1f1b", 1, "adamw"), ("1f1b", 8, "sgd"),
              ("interleaved", 4, "adamw"), ("interleaved", 8, "sgd")]}
# the pipeline inside a mesh dimension: schedule -> (m, optimizer)
MESH = {"1f1b": (4, "sgd"), "interleaved": (4, "adamw")}
# (schedule, m) whose bubble is measured, per p
BUBBLE = {2: [("gpipe", 4), ("1f1b", 4), ("interleaved", 4)], 4: [("gpipe", 8), ("1f1b", 8), ("interleaved", 8)]}
MEMORY_M = 8
ORDER_OF = {"1f1b": pytest.mark.exercise("12.2"), "interleaved": pytest.mark.exercise("12.4")}  # the exercises


def by_schedule(name, *values, mechanism=False):
    """A parametrize case that runs schedule `name`: graded with the exercise that writes its order (mechanism:
    and the case checks how the order is run, not only what it computes)."""
    if name not in ORDER_OF:
        return pytest.param(*values)
    return pytest.param(*values, marks=[ORDER_OF[name]] + [pytest.mark.mechanism] * mechanism)


def activation_shape(m, config=CONFIG):
    return (BATCH // m, config.block_size, config.n_embd)


# -- the orders, on paper -------------------------------------------------------------------------------------------
# Exercises 12.2 and 12.4 are graded on what any good order must do, not on one list of actions: every action
# once, each stage's micro-batches in order; at most so many micro-batches in flight; the bubble of the formula on
# the ideal machine. For 1F1B these leave exactly one order (checked by enumerating every order for p <= 4,
# m <= 6: only p - rank - 1 forwards, the pairs, the drain, hold min(p - rank, m) and leave GPipe's bubble); for
# the interleaved schedule, many (Megatron's is one).
EXERCISE = {"gpipe": None, "1f1b": "12.2", "interleaved": "12.4"}
ORDER_PS, ORDER_MS = (1, 2, 3, 4), (1, 2, 3, 4, 8, 12)


def order_of(name, r, p, m, v=None):
    if name == "gpipe":
        return gpipe_order(r, p, m)
    if name == "1f1b":
        return one_f_one_b_order(r, p, m)
    return interleaved_order(r, p, V[name] if v is None else v, m)


def budget(name, r, p, m, v=None):
    """The most (stage, micro-batch) pieces rank r may hold at once: GPipe all m; 1F1B min(p - r, m); interleaved
    Megatron's min(2(p - r - 1) + (v - 1)p + 1, v m)."""
    v = V[name] if v is None else v
    return {"gpipe": m, "1f1b": min(p - r, m),
            "interleaved": min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)}[name]


def _where(name):
    return f" (exercise {EXERCISE[name]})" if EXERCISE[name] else ""


def _order_cases(names, ps=ORDER_PS, ms=ORDER_MS, vs=(2,)):
    """(name, p, m, v) cases, each marked with the exercise that writes its order; the interleaved order only
    where m is a multiple of p (its input contract), and with each of `vs` virtual stages per rank."""
    cases = []
    for name in names:
        for p in ps:
            for m in ms:
                if name == "interleaved" and m % p:
                    continue
                for v in (vs if name == "interleaved" else (1,)):
                    marks = [ORDER_OF[name]] if name in ORDER_OF else []
                    tag = f"{name}-p{p}-m{m}" + (f"-v{v}" if name == "interleaved" else "")
                    cases.append(pytest.param(name, p, m, v, id=tag, marks=marks))
    return cases


def _fmt(actions):
    return " ".join(str(a).replace(" ", "") for a in actions)


@pytest.mark.parametrize("name, p, m, v", _order_cases(SCHEDULES, vs=(2, 3)))
def test_every_order_runs_each_action_once_forward_first_backwards_in_order(name, p, m, v):
    where = _where(name)
    for r in range(p):
        order = order_of(name, r, p, m, v)
        stages = stages_of_rank(r, p, v)
        assert isinstance(order, list) and all(isinstance(a, Action) for a in order), (
            f"{name} order of rank {r} (p = {p}, m = {m}) is not a list of Action{where}")
        expected = sorted(Action(k, s, i) for k in (FORWARD, BACKWARD) for s in stages for i in range(m))
        assert sorted(order) == expected, (
            f"{name} order of rank {r} (p = {p}, m = {m}, stages {stages}) has {len(order)} actions, expected each "
            f"of the {len(expected)} forwards and backwards of its stages exactly once{where}: "
            f"missing {_fmt(sorted(set(expected) - set(order)))!r}, extra or repeated "
            f"{_fmt(sorted(a for a in set(order) if order.count(a) > 1 or a not in expected))!r}")
        for s in stages:
            for kind, what in ((FORWARD, "forwards"), (BACKWARD, "backwards")):
                seen = [a.microbatch for a in order if a.stage == s and a.kind == kind]
                assert seen == list(range(m)), (
                    f"{name} order of rank {r} (p = {p}, m = {m}) runs the {what} of stage {s} in micro-batch order "
                    f"{seen}, expected 0 to {m - 1} in turn{where}: each stage takes its micro-batches in order, so "
                    f"that its gradients add up in the order of torch's schedules")
            late = [i for i in range(m) if order.index(Action(FORWARD, s, i)) > order.index(Action(BACKWARD, s, i))]
            assert not late, (
                f"{name} order of rank {r} (p = {p}, m = {m}) runs the backward of micro-batch {late[0]} through "
                f"stage {s} before its forward{where}: a backward needs what its forward saved")


def peak_of(order):
    """Most micro-batches forward and not yet backward, running `order` as written."""
    now = peak = 0
    for a in order:
        now += 1 if a.kind == FORWARD else -1
        peak = max(peak, now)
    return peak


@pytest.mark.mechanism
@pytest.mark.parametrize("name, p, m, v", _order_cases(SCHEDULES, vs=(2, 3)))
def test_micro_batches_in_flight_by_the_order(name, p, m, v):
    for r in range(p):
        order = order_of(name, r, p, m, v)
        held, most = peak_of(order), budget(name, r, p, m, v)
        if name == "gpipe":
            assert held == m, f"GPipe on rank {r} of {p} held {held} micro-batches at its peak, expected all {m}"
            continue
        what = "(stage, micro-batch) pieces'" if name == "interleaved" else "micro-batches'"
        assert held <= most, (
            f"the {name} order of rank {r} of {p} (m = {m}{f', v = {v}' if name == 'interleaved' else ''}) holds "
            f"{held} {what} activations at its peak (forwards run, backwards not yet), expected at most "
            f"{most}{_where(name)}: does it run more forwards before its first backward than the time micro-batch 0 "
            f"takes to come back, or admit a new micro-batch without freeing one? "
            f"The order: {_fmt(order)}")


@pytest.mark.mechanism
@pytest.mark.parametrize("name, p, m, v", _order_cases(SCHEDULES, ps=(2, 3, 4), vs=(2, 3)))
def test_on_an_ideal_machine_the_bubble_is_the_formula(name, p, m, v):
    orders = [order_of(name, r, p, m, v) for r in range(p)]
    where, size = _where(name), f"p = {p}, m = {m}" + (f", v = {v}" if name == "interleaved" else "")
    try:  # every forward 1/v, every backward 2/v: a rank's work is 3m whatever v
        spans = simulate(orders, 1.0 / v, 2.0 / v)
    except RuntimeError as e:
        raise AssertionError(
            f"the {name} orders of the {p} ranks ({size}) cannot finish{where}: {e}. Does a rank wait for a "
            f"backward that comes back only after a forward it has put later?") from None
    bubbles, formula = bubble_fractions(spans), bubble_formula(p, m, v)
    for r, bubble in enumerate(bubbles):
        assert bubble <= formula + 1e-12, (
            f"on the ideal machine (a backward twice a forward, messages at once) the {name} orders ({size}) leave "
            f"rank {r} idle {bubble:.3f} of the step, expected the formula's {formula:.3f}{where}: does a rank wait "
            f"for a backward when it could run a forward, or start its backwards before the micro-batches it "
            f"sent could come back? Rank {r}'s order: {_fmt(orders[r])}")
    assert [in_flight_peak(s) for s in spans] == [peak_of(o) for o in orders]


def test_simulate_finds_an_order_that_cannot_finish():
    # both ranks want micro-batch 1's backward before micro-batch 0's: rank 1 first needs its forward of 1,
    # which it puts after the backward of 0, which needs rank 1 ... rank 0 waits for rank 1's backward of 1.
    orders = [[Action(FORWARD, 0, 0), Action(FORWARD, 0, 1), Action(BACKWARD, 0, 1), Action(BACKWARD, 0, 0)],
              [Action(FORWARD, 1, 0), Action(BACKWARD, 1, 0), Action(BACKWARD, 1, 1), Action(FORWARD, 1, 1)]]
    with pytest.raises(RuntimeError, match="cannot finish"):
        simulate(orders, 1.0, 2.0)


def test_splitting_gpt_keeps_the_names_and_cuts_evenly():
    model = TinyGPT(CONFIG, seed=0)
    first, last = split_gpt(model, 4, [0, 3])
    assert [n for n, _ in first.named_parameters()][:2] == ["wte.weight", "wpe.weight"]
    assert {n.split(".")[1] for n, _ in first.named_parameters() if n.startswith("blocks.")} == {"0", "1"}
    assert {n.split(".")[1] for n, _ in last.named_parameters() if n.startswith("blocks.")} == {"6", "7"}
    assert last.lm_head.weight is first.wte.weight  # both ends on one rank: one parameter, as in the model
    assert first.tied_embedding is None and last.tied_embedding is None
    head, = split_gpt(TinyGPT(CONFIG, seed=0), 4, [3])
    tail, = split_gpt(TinyGPT(CONFIG, seed=0), 4, [0])
    assert head.tied_embedding == "lm_head.weight" and tail.tied_embedding == "wte.weight"
    assert torch.equal(head.lm_head.weight, tail.wte.weight)  # two copies, started equal


@pytest.mark.exercise("12.2")
def test_the_gantt_chart_draws(tmp_path):
    p, m = 4, 8
    orders = [one_f_one_b_order(r, p, m) for r in range(p)]
    plot_pipeline(simulate(orders, 0.01, 0.02), str(tmp_path / "1f1b.png"), title="1F1B, p = 4, m = 8")
    assert (tmp_path / "1f1b.png").stat().st_size > 10_000


def test_n_layer_not_divisible_by_the_stages_is_a_clear_error():
    with pytest.raises(ValueError, match="8 blocks cannot be cut into 3 stages"):
        split_gpt(TinyGPT(CONFIG, seed=0), 3, [0])
    with pytest.raises(ValueError, match="cannot be cut into 16 stages"):
        split_gpt(TinyGPT(CONFIG, seed=0), 4 * 4, [0])


# -- on ranks ------------------------------------------------------------------------------------------------------
def build(name, m, v=None, group=None, config=CONFIG, compute_time=None):
    """This rank's stage modules (in a ModuleList: a parameter shared by two of them is listed once) and the
    schedule that runs them."""
    v = V[name] if v is None else v
    p, r = comm.world_size(group), comm.rank(group)
    indices = stages_of_rank(r, p, v)
    modules = nn.ModuleList(split_gpt(TinyGPT(config, seed=0), p * v, indices))
    stages = [PipelineStage(mod, s, p * v, group=group, activation_shape=activation_shape(m, config))
              for mod, s in zip(modules, indices)]
    schedule = SCHEDULES[name](stages if name == "interleaved" else stages[0], m, loss_fn=gpt_loss,
                               compute_time=compute_time)
    return modules, schedule


def reference(optimizer):
    """One process, the whole batch: each step's loss and gradients, and the parameters after it."""
    model = TinyGPT(CONFIG, seed=0)
    opt = OPTIMIZERS[optimizer](model.parameters())
    out = []
    for step in range(STEPS):
        x, y = gpt_batch(CONFIG, step, BATCH)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        grads = {n: q.grad.clone() for n, q in model.named_parameters()}
        opt.step()
        out.append((loss.item(), grads, {n: q.detach().clone() for n, q in model.named_parameters()}))
    return out


def full_name(name):
    return "wte.weight" if name == "lm_head.weight" else name  # the tied copy on the last stage


def parity_run(name, m, optimizer, refs, group=None, v=None):
    modules, schedule = build(name, m, v, group)
    opt = OPTIMIZERS[optimizer](modules.parameters())
    grad_diff = param_diff = loss_diff = 0.0
    for step in range(STEPS):
        x, y = gpt_batch(CONFIG, step, BATCH)
        opt.zero_grad()
        losses = []
        mean = schedule.step(x, target=y, losses=losses)
        ref_loss, ref_grads, ref_params = refs[optimizer][step]
        if mean is not None:
            assert len(losses) == m
            loss_diff = max(loss_diff, abs(mean.item() - ref_loss))
        named = [(n, q) for mod in modules for n, q in mod.named_parameters()]
        grad_diff = max(grad_diff, max((q.grad - ref_grads[full_name(n)]).abs().max().item() for n, q in named))
        opt.step()
        param_diff = max(param_diff, max((q - ref_params[full_name(n)]).abs().max().item() for n, q in named))
    return {"grads": grad_diff, "params": param_diff, "loss": loss_diff}


def bubble_run(name, m):
    from minifsdp.measure.timeline import Timeline

    v = V[name]
    modules, schedule = build(name, m, compute_time=(COMPUTE_TIME[0] / v, COMPUTE_TIME[1] / v))
    x, y = gpt_batch(CONFIG, 0, BATCH)
    schedule.compute_time, compute_time = None, schedule.compute_time
    schedule.step(x, target=y)  # the first messages between two ranks also connect them: not in the picture
    modules.zero_grad()
    schedule.compute_time = compute_time
    # The fastest of two steps: a step that another process on the machine delayed shows a bubble that
    # is the machine's, not the schedule's (the timings' usual rule: keep the least disturbed run).
    runs = []
    for _ in range(2):
        modules.zero_grad()
        with Timeline() as tl:
            schedule.step(x, target=y)
        runs.append(tl.spans())
    took = torch.tensor([max(s.end for s in spans) - min(s.start for s in spans) for spans in runs])
    comm.all_reduce(took, op=comm.ReduceOp.MAX)  # every rank keeps the same step: the one all finished soonest
    return {"spans": runs[int(took.argmin())], "order": [str(a) for a in schedule.order(schedule.rank)]}


def memory_run(name, m):
    from minifsdp import MemoryMeter

    modules, schedule = build(name, m)
    x, y = gpt_batch(CONFIG, 0, BATCH)
    schedule.step(x, target=y)
    modules.zero_grad()
    meter = MemoryMeter(modules)
    meter.reset_peak()
    with meter:
        schedule.step(x, target=y)
    meter.close()
    return meter.category_peak["other"]


def bytes_run(name, m):
    _, schedule = build(name, m)
    x, y = gpt_batch(CONFIG, 0, BATCH)
    with comm.counting(record=True) as counter:
        schedule.step(x, target=y)
    return {"send": counter.bytes["send"], "recv": counter.bytes["recv"],
            "kinds": sorted(counter.bytes), "messages": sorted(e.tag for e in counter.events if e.kind == "send")}


def raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test looks at which, and at the message
        return type(e).__name__, str(e)
    return None


def errors():
    p, r = comm.world_size(), comm.rank()
    out = {"interleaved_m": raised(lambda: build("interleaved", 3))}
    module, = split_gpt(TinyGPT(CONFIG, seed=0), p, [r])
    out["wrong_rank"] = raised(lambda: PipelineStage(module, (r + 1) % p, p, activation_shape=activation_shape(4)))
    out["no_shape"] = raised(lambda: PipelineStage(module, r, p))
    modules = split_gpt(TinyGPT(CONFIG, seed=0), 2 * p, stages_of_rank(r, p, 2))
    stages = [PipelineStage(mod, mod.stage_index, 2 * p, activation_shape=activation_shape(4)) for mod in modules]
    out["1f1b_virtual"] = raised(lambda: Schedule1F1B(stages, 4, loss_fn=gpt_loss))
    out["missing_stage"] = raised(lambda: ScheduleInterleaved1F1B(stages[:1], 4, loss_fn=gpt_loss))
    out["no_loss"] = raised(lambda: Schedule1F1B(PipelineStage(module, r, p, activation_shape=activation_shape(4)),
                                                 4))
    if r in (0, p - 1):  # the ranks that hold the batch say so before any message (the others would wait)
        _, schedule = build("1f1b", 3)
        x, y = gpt_batch(CONFIG, 0, BATCH)
        out["uneven_batch"] = raised(lambda: schedule.step(x, target=y))
    return out


def torch_oracle(name, m):
    """Our schedule and torch.distributed.pipelining's, the same stage modules (untied: torch's schedules do not
    sum a tied weight's gradients), one step each: every gradient's largest difference."""
    import torch.distributed.pipelining as tpp

    config = GPTConfig(**{**CONFIG.__dict__, "tie_weights": False})
    x, y = (t.contiguous() for t in gpt_batch(config, 0, BATCH))  # torch checks strides against its example
    modules, schedule = build(name, m, config=config)
    schedule.step(x, target=y)
    ours = {n: q.grad for n, q in modules.named_parameters()}
    p, r, v = comm.world_size(), comm.rank(), V[name]
    indices = stages_of_rank(r, p, v)
    modules = nn.ModuleList(split_gpt(TinyGPT(config, seed=0), p * v, indices))
    stages = [tpp.PipelineStage(mod, s, p * v, torch.device("cpu"),
                                input_args=(x[: BATCH // m] if s == 0 else torch.zeros(activation_shape(m)),))
              for mod, s in zip(modules, indices)]
    cls = {"gpipe": tpp.ScheduleGPipe, "1f1b": tpp.Schedule1F1B, "interleaved": tpp.ScheduleInterleaved1F1B}[name]
    theirs = cls(stages if v > 1 else stages[0], m, loss_fn=gpt_loss)
    if r == 0:
        theirs.step(x)
    elif r == p - 1:
        theirs.step(target=y)
    else:
        theirs.step()
    return max((q.grad - ours[n]).abs().max().item() for n, q in modules.named_parameters())


def rank_cases():
    from minifsdp.distributed.mesh import init_mesh

    p = comm.world_size()
    refs = {opt: reference(opt) for opt in ("sgd", "adamw")}
    out = {("parity", *case): parity_run(*case, refs) for case in PARITY[p]}
    # the pipeline inside a mesh: p/2 stages in each row ({0, 1} and {2, 3} at 4 ranks); at 2 ranks each rank
    # is a pipeline of one stage, holding both ends of the tie (and with v = 2, two stages handing over locally)
    mesh = init_mesh((2, p // 2), ("dp", "pp"))
    for name, (m, opt) in MESH.items():
        out[("mesh", name)] = parity_run(name, m, opt, refs, group=mesh.get_group("pp"))
    for name, m in BUBBLE[p]:
        out[("bubble", name, m)] = bubble_run(name, m)
    for name in ("gpipe", "1f1b"):
        out[("memory", name)] = memory_run(name, MEMORY_M)
    for name in SCHEDULES:
        out[("bytes", name)] = bytes_run(name, 4)
    out["errors"] = errors()
    if p == 2:
        for name, m in (("gpipe", 4), ("1f1b", 8), ("interleaved", 4)):
            out[("torch", name, m)] = torch_oracle(name, m)
    return out


@pytest.fixture(scope="module")
def ranks():
    return {p: launch(rank_cases, world_size=p, device="cpu") for p in (2, 4)}


# -- the tests on ranks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, case", [by_schedule(case[0], p, case) for p in PARITY for case in PARITY[p]],
                         ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else f"p{c}")
def test_every_schedule_trains_as_one_process_on_the_whole_batch(ranks, p, case):
    atol = ATOL[case[2]]
    for r in range(p):
        d = ranks[p][r][("parity", *case)]
        assert d["grads"] <= GRAD_ATOL and d["params"] <= atol and d["loss"] <= atol, (r, d)
        if case[1] == 1:  # one micro-batch: the single process's very operations
            assert d == {"grads": 0.0, "params": 0.0, "loss": 0.0}, (r, d)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", [by_schedule(name, name) for name in MESH])
def test_a_pipeline_in_a_mesh_dimension(ranks, p, name):
    atol = ATOL[MESH[name][1]]
    for r in range(p):
        d = ranks[p][r][("mesh", name)]
        assert d["grads"] <= GRAD_ATOL and d["params"] <= atol and d["loss"] <= atol, (r, d)


@pytest.mark.parametrize("case", [by_schedule(c[0], c) for c in (("gpipe", 4), ("1f1b", 8), ("interleaved", 4))],
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_same_gradients_as_torch_pipelining(ranks, case):
    assert [ranks[2][r][("torch", *case)] for r in range(2)] == [0.0, 0.0]


@pytest.mark.parametrize("p, name, m", [by_schedule(name, p, name, m) for p in BUBBLE for name, m in BUBBLE[p]])
def test_measured_bubble_is_the_formula(ranks, p, name, m):
    timelines = [ranks[p][r][("bubble", name, m)]["spans"] for r in range(p)]
    expected = bubble_formula(p, m, V[name])
    measured = bubble_fractions(timelines)
    assert measured == pytest.approx([expected] * p, abs=BUBBLE_ATOL), (
        f"{name} at p = {p}, m = {m} measured bubbles {', '.join(f'{b:.3f}' for b in measured)} by rank, expected "
        f"the formula's {expected:.3f} within {BUBBLE_ATOL}{_where(name)} (a loaded machine adds a little to every "
        f"hop; far above it, the order makes ranks wait)")


@pytest.mark.parametrize("p, name, m", [by_schedule(name, p, name, m, mechanism=True)
                                        for p in BUBBLE for name, m in BUBBLE[p]])
def test_each_rank_ran_its_order_and_held_what_it_predicts(ranks, p, name, m):
    for r in range(p):
        result = ranks[p][r][("bubble", name, m)]
        ran = [str(a) for a, _, _ in pipeline_actions(result["spans"])]
        assert ran == result["order"], (
            f"{name} on rank {r} of {p} ran {' '.join(ran)!r}, not its order {' '.join(result['order'])!r}"
            f"{_where(name)}")
        held, most = in_flight_peak(result["spans"]), budget(name, r, p, m)
        if name == "gpipe":
            assert in_flight_peaks(result["spans"]) == {r: m}, f"GPipe on rank {r} of {p} held {held}, expected {m}"
        else:
            assert held <= most, (
                f"{name} on rank {r} of {p} (m = {m}) held {held} micro-batches' activations at once while it ran, "
                f"expected at most {most}{_where(name)}: its order admits micro-batches faster than it frees them")


@pytest.mark.mechanism
@pytest.mark.exercise("12.2")
@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_holds_fewer_activations_than_gpipe(ranks, p):
    gpipe = [ranks[p][r][("memory", "gpipe")] for r in range(p)]
    one_f_one_b = [ranks[p][r][("memory", "1f1b")] for r in range(p)]
    for r, (g, o) in enumerate(zip(gpipe, one_f_one_b)):
        assert g > o, (
            f"rank {r} of {p} held {o:,} B of activations at its peak under 1F1B, not less than GPipe's {g:,} B "
            f"(m = {MEMORY_M}; exercise 12.2): does the 1F1B order run every forward before its first backward?")
    assert one_f_one_b == sorted(one_f_one_b, reverse=True), (  # p - r micro-batches: fewer each rank
        f"1F1B's activation peaks by rank, {', '.join(f'{b:,} B' for b in one_f_one_b)}, do not fall from rank 0 "
        f"to rank {p - 1} (exercise 12.2): rank r should hold p - r micro-batches, fewer on each later rank")


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", [by_schedule(name, name) for name in SCHEDULES])
def test_each_activation_and_gradient_crosses_each_boundary_once(ranks, p, name):
    m, v = 4, V[name]
    message = 4 * (BATCH // m) * CONFIG.block_size * CONFIG.n_embd  # fp32 bytes of one micro-batch's activation
    tied = CONFIG.vocab_size * CONFIG.n_embd * 4  # the embedding's gradient, to the other end and back
    for r in range(p):
        stages = stages_of_rank(r, p, v)
        forward = sum(s < p * v - 1 for s in stages)  # boundaries this rank sends activations across
        backward = sum(s > 0 for s in stages)         # ... and gradients
        ends = (r == 0) + (r == p - 1)
        got = ranks[p][r][("bytes", name)]
        assert got["kinds"] == ["recv", "send"] and got["recv"] == 0, (
            f"{name} on rank {r} of {p} issued {got['kinds']} with {got['recv']:,} B counted as received: a "
            f"pipeline sends point to point and nothing else")
        want = (forward + backward) * m * message + ends * tied
        assert got["send"] == want, (
            f"{name} on rank {r} of {p} sent {got['send']:,.0f} B in a step, expected {want:,} B: one activation "
            f"and one gradient of {message:,} B per micro-batch across each of its boundaries, plus the tied "
            f"embedding's {tied:,} B on the end ranks")
        expected = sorted([f"activation {i} to s{s + 1}" for s in stages if s < p * v - 1 for i in range(m)]
                          + [f"gradient {i} to s{s - 1}" for s in stages if s > 0 for i in range(m)]
                          + ["tied embedding"] * ends)
        assert got["messages"] == expected, (
            f"{name} on rank {r} of {p}: the messages sent are not one per micro-batch and boundary "
            f"(got {got['messages']}, expected {expected})")


@pytest.mark.parametrize("p", [2, 4])
def test_clear_errors(ranks, p):
    for r in range(p):
        e = ranks[p][r]["errors"]
        assert e["interleaved_m"][0] == "ValueError" and "must be divisible by p" in e["interleaved_m"][1]
        assert e["wrong_rank"][0] == "ValueError" and f"lives on rank {(r + 1) % p}" in e["wrong_rank"][1]
        assert e["no_shape"][0] == "ValueError" and "activation_shape" in e["no_shape"][1]
        assert e["1f1b_virtual"][0] == "ValueError" and "ScheduleInterleaved1F1B" in e["1f1b_virtual"][1]
        assert e["missing_stage"][0] == "ValueError" and "must be given its stages" in e["missing_stage"][1]
        if r == p - 1:
            assert e["no_loss"][0] == "ValueError" and "a loss_fn" in e["no_loss"][1]
        else:
            assert e["no_loss"] is None  # only the last stage computes a loss
        if r in (0, p - 1):
            assert e["uneven_batch"][0] == "ValueError" and "16 does not cut into 3" in e["uneven_batch"][1]
