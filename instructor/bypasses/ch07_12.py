"""Wrong solutions to the exercises of chapters 7 to 13 that still get the numbers right.

Each entry is the code of one exercise block (the lines between its BEGIN and END EXERCISE markers), written
at indentation zero: put in place of the block, at the block's indentation, it makes every test that checks
values pass, and at least one of the exercise's tests marked `mechanism` fail -- the tests that check how
the result is reached (the collectives issued and their bytes, the order things happen in, views instead
of copies). A grader that scores an exercise by its tests can run each of these to show that the
mechanism tests are what tell a right solution from a lucky one.

    7.1, 7.2   no prefetch at all: the same collectives, each issued only when its own unit needs it
    7.3        the waits' time on the wire added up wait by wait: two waits over the same moment count twice
    8.1        the fp32 masters gathered, then cast: param_dtype's bytes are not what crosses the wire
    8.2        the flag agreed on with torch.distributed itself, around comm: the counter never sees it
    9.1        no_sync() ignored: every micro-batch reduce-scattered, the shards added up afterwards
    9.2        every rank's partial sum gathered as a Python object, instead of one all-reduce of one number
    10.1       a partial row cut into runs of the last dimension, not one dimension down: right for matrices,
               more boxes than the fewest that cover the range for a tensor of 3 dimensions or more
    10.2       each rank cuts only its own range and asks the others for theirs: a collective per tensor
    11.1       the shard a view into a full-size padded copy: the right rows, and the whole parameter kept
    11.2       all-reduce then slice: the same average, with twice a reduce-scatter's bytes
    12.1       the sums made with torch.distributed itself, around comm: the counter never sees them
    12.2       GPipe's order (every forward, then every backward): the same gradients, m micro-batches held
    12.3       every rank's V/t logits of each token all-gathered, instead of three numbers per token
    12.4       every forward of every stage, then every backward: the same gradients and even the same
               bubble, with all v*m pieces held
    13.2       one queue for every collective, whatever its channel: right while one process group
               communicates, HSDP's replicas queued behind its shard group

One exception, in NUMERICAL_FAILURES: 9.1's bypass gets numbers a rounding away from the right ones
(averaging each micro-batch and adding the averages is not, to the last bit, averaging their sum), and
test_no_sync_accumulation_equals_ddps holds FSDP to torch's DDP bit for bit at N = 2, so those cases fail
too. At N = 1 (exactly), at N = 3 and 4 (within 1e-6), and in every other test, the numbers pass.
"""

NUMERICAL_FAILURES = {  # exercise -> tests that check values and fail under its bypass all the same
    "9.1": ["tests/test_ch09_training.py::test_no_sync_accumulation_equals_ddps[sgd-2]",
            "tests/test_ch09_training.py::test_no_sync_accumulation_equals_ddps[adamw-2]"],
}

# exercise -> the mechanism tests that must fail under its bypass, on an assertion (check.py --quick runs these;
# a test run for every world size is named at N = 2, the smallest that communicates: the full run has the rest)
CAUGHT_BY = {
    "7.1": ["tests/test_ch07_overlap.py::test_forward_prefetch_issues_the_next_all_gather_before_computing[2]"],
    "7.2": ["tests/test_ch07_overlap.py::test_backward_issue_order_matches_the_mode[2]"],
    "7.3": ["tests/test_ch07_overlap.py::test_hidden_fraction_counts_each_moment_once"],
    "8.1": ["tests/test_ch08_precision.py::test_the_all_gather_carries_param_dtype_bytes[2]"],
    "8.2": ["tests/test_ch08_precision.py::test_the_ranks_agree_with_one_all_reduce_of_one_number[2]"],
    "9.1": ["tests/test_ch09_training.py::test_no_sync_sends_nothing_and_keeps_each_units_full_gradient[2]"],
    "9.2": ["tests/test_ch09_training.py::test_clipping_sends_one_number[fsdp-l2-2]",
            "tests/test_ch09_training.py::test_the_norm_sends_one_number_however_the_gradient_is_cut[2]"],
    "10.1": ["tests/test_ch10_flat_chunks.py::test_boxes_are_the_fewest_the_cut_needs"],
    "10.2": ["tests/test_ch10_fsdp_state_dicts.py::test_sharded_state_dict_is_views_into_the_shards_with_no_collective[2]"],
    "11.1": ["tests/test_ch11_fully_shard.py::test_each_rank_holds_only_its_padded_rows[2]"],
    "11.2": ["tests/test_ch11_fully_shard.py::test_backward_reduce_scatters_each_group_once[2]"],
    "12.1": ["tests/test_ch12_tensor_parallel.py::test_f_and_g_sum_in_two_of_their_four_passes[2]"],
    "12.2": ["tests/test_ch12_pipeline.py::test_micro_batches_in_flight_by_the_order[1f1b-p4-m8]"],
    "12.3": ["tests/test_ch12_tensor_parallel.py::test_vocab_parallel_loss_sends_three_numbers_per_token[2]"],
    "12.4": ["tests/test_ch12_pipeline.py::test_micro_batches_in_flight_by_the_order[interleaved-p2-m4-v2]"],
    "13.2": ["tests/test_ch13_step_time.py::test_each_channel_is_a_fifo_of_its_own"],
}

BYPASSES = {
    "7.1": '''\
pass
''',

    "7.2": '''\
pass
''',

    "7.3": '''\
comm_spans = [(s.start, s.end) for s in spans if s.lane not in ("compute", "wait")]
busy = _union_length(comm_spans)
if busy == 0:
    return 1.0
exposed = 0.0
for w in spans:  # each wait's time on the wire, wait by wait
    if w.lane == "wait":
        exposed += sum(max(0.0, min(e, w.end) - max(s, w.start)) for s, e in _merge(comm_spans))
return 1.0 - exposed / busy
''',

    "8.1": '''\
shard = self._shard
if self.offload:
    shard = comm.copy_to(shard, self._full.device, "host_to_device")
if shard.dtype != self.param_dtype:  # gather the fp32 masters first, cast after
    full = shard.new_empty(shard.numel() * self.world_size)
    comm.all_gather(full, shard, tag=f"fp32 {self.name}", group=self.group)
    start = self.rank * self.shard_numel
    shard = full.to(self.param_dtype)[start: start + self.shard_numel]
return shard
''',

    "8.2": '''\
import torch.distributed as dist

found_inf = torch.zeros(1, device=current_device())
for g in grads:
    g.mul_(1.0 / self.scale_value)
    found_inf += (~torch.isfinite(g)).any().to(found_inf.device)
self.local_found_inf.append(bool(found_inf.item()))
dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)  # around comm
self._found_inf[id(optimizer)] = bool(found_inf.item())
''',

    "9.1": '''\
return False  # inside no_sync() too: each micro-batch is reduce-scattered, and the runtime adds up the shards
''',

    "9.2": '''\
norms = torch.stack([torch.linalg.vector_norm(g, p).to(device) for g in grads]) if grads \\
    else torch.zeros(1, device=device)
mine = float(norms.max()) if p == float("inf") else float(norms.pow(p).sum())
everyone = comm.all_gather_object(mine, group=group)  # every rank's number, as a Python object
total = torch.tensor(max(everyone) if p == float("inf") else sum(everyone) ** (1.0 / p), device=device)
''',

    "10.1": '''\
if start >= end:
    return []
if len(shape) <= 1:
    return [((start,), (end - start,))] if len(shape) == 1 else [((), ())]


def runs(lo, hi):  # a partial row as runs along the last dimension, as if every tensor were a matrix
    out, at = [], lo
    while at < hi:
        stop = min(hi, (at // shape[-1] + 1) * shape[-1])
        index, rest = [], at
        for size in reversed(shape):
            index.append(rest % size)
            rest //= size
        out.append((tuple(reversed(index)), (1,) * (len(shape) - 1) + (stop - at,)))
        at = stop
    return out


row = math.prod(shape[1:])
first, last = -(-start // row), end // row
if first > last:
    return runs(start, end)
out = runs(start, first * row)
if first < last:
    out.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])))
return out + runs(last * row, end)
''',

    "10.2": '''\
if q == 0:  # ask every rank for its boxes, instead of working them out
    mine_lo = max(offset, shard_start)
    mine_hi = min(offset + numel, shard_start + shard_numel)
    everyone = comm.all_gather_object(boxes(shape, mine_lo - offset, mine_hi - offset), group=group)
for box_offsets, sizes in everyone[q]:
    metadata.append(ShardMetadata(list(box_offsets), list(sizes), f"rank:{ranks[q]}/{local.device}"))
    if q * shard_numel == shard_start:
        begin = offset + flat_start(shape, box_offsets) - shard_start
        mine.append(Shard(local[begin: begin + math.prod(sizes)].view(sizes), metadata[-1]))
''',

    "11.1": '''\
self.rows = -(-param.shape[0] // world_size)
first = min(rank * self.rows, param.shape[0])
self.length = min(self.rows, param.shape[0] - first)
full = param.new_zeros((self.rows * world_size,) + tuple(param.shape[1:]))  # every rank's rows, padded
full[: param.shape[0]].copy_(param.detach())
padded = full[rank * self.rows: (rank + 1) * self.rows]  # a view: the whole of `full` stays alive
''',

    "11.2": '''\
inp = torch.zeros(n, sum(p.padded_numel for p in params), dtype=dtype, device=grads[0][1].device)
offset = 0
for i, (p, grad) in enumerate(grads):
    whole, last = _by_rank(grad, p.rows)
    inp[: len(whole), offset: offset + whole.shape[1]].copy_(whole)
    if last is not None:
        inp[len(whole), offset: offset + last.numel()].copy_(last)
    grads[i] = grad = whole = last = None
    offset += p.padded_numel
comm.all_reduce(inp, op=comm.ReduceOp.AVG, tag=f"all_reduce {self.name}", group=self.group)  # every slot ...
out = inp[self.rank].clone()  # ... of which this rank keeps its own
comm.release(inp)
if self.replicate_group is not None:
    comm.all_reduce(out, op=comm.ReduceOp.AVG, tag=f"all_reduce {self.name}", group=self.replicate_group)
''',

    "12.1": '''\
import torch.distributed as dist

sums = (mapping, direction) in (("f", "backward"), ("g", "forward"))
if not sums or comm.world_size(group) == 1:
    return x
out = x.clone(memory_format=torch.contiguous_format)
dist.all_reduce(out, group=group)  # around comm
return out
''',

    "12.2": '''\
return [Action(FORWARD, rank, i) for i in range(m)] + [Action(BACKWARD, rank, i) for i in range(m)]
''',

    "12.3": '''\
per_rank = logits.shape[-1]
start = comm.rank(group) * per_rank
elsewhere = (target < start) | (target >= start + per_rank)
local_target = (target - start).masked_fill(elsewhere, 0)
if t > 1:  # every rank's V/t logits of every token
    gathered = logits.new_empty((t,) + tuple(logits.shape))
    comm.all_gather(gathered.view(-1), logits.contiguous().view(-1), group=group, tag="cross entropy logits")
    whole = torch.cat(gathered.unbind(0), dim=-1)
else:
    whole = logits
logits_max = whole.max(dim=-1).values
exp = (logits - logits_max.unsqueeze(-1)).exp()
sum_exp = (whole - logits_max.unsqueeze(-1)).exp().sum(dim=-1)
target_logit = whole.gather(-1, target.unsqueeze(-1)).squeeze(-1) - logits_max
loss = sum_exp.log() - target_logit
''',

    "12.4": '''\
stages = [rank + c * p for c in range(v)]
return ([Action(FORWARD, s, i) for s in stages for i in range(m)]
        + [Action(BACKWARD, s, i) for s in reversed(stages) for i in range(m)])
''',

    "13.2": '''\
if isinstance(op, Collective):  # one queue for every collective, whatever its channel
    start = max([now, free["all"]] + [done[t] for t in op.after])
    done[op.tag] = free["all"] = start + op.seconds
    spans.append(Span(op.kind, op.tag, start, start + op.seconds))
    comm += op.seconds
elif done[op.tag] > now:
    spans.append(Span("wait", op.tag, now, done[op.tag]))
    waiting += done[op.tag] - now
    now = done[op.tag]
''',
}
