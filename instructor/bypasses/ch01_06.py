"""Wrong solutions to the exercises of chapters 1 to 6 that still get the numbers right.

Each entry is the code of one exercise block (the lines between its BEGIN and END EXERCISE markers), written
at indentation zero: put in place of the block, at the block's indentation, it makes every test that checks
values pass, and at least one of the exercise's tests marked `mechanism` fail -- the tests that check how
the result is reached (the collectives issued and their bytes, the order of issues and waits, the memory
kept). A grader that scores an exercise by its tests can run each of these to show that the mechanism
tests are what tell a right solution from a lucky one.

    1.1   a plain all-reduce, not built from reduce-scatter + all-gather
    1.2   each bucket's all-reduce waited for at once, in the hook: nothing overlaps backward
    1.3   a new tensor per parameter instead of the average copied into the .grad autograd made
    1.4   one bucket per dtype, whatever the cap: the same averages, all sent once backward is over
    3.1   greedy in registration order: within one parameter, but far from the best possible split
    3.2   one broadcast per parameter instead of one flat tensor per owner
    3.3   all-reduce then slice: the same average, with twice a reduce-scatter's bytes
    4.1   the owner keeps its own gradients through backward; only the ones sent away are dropped
    4.2   all-reduce then slice, waited for at once: twice the bytes, and no overlap
    4.3   a whole cap for each owner's bucket: one owner each, but up to N caps of gradients wait unsent
    5.1   the shard a view into a full-size copy: the right values, the whole unit kept
    5.2   all-reduce then slice: the same shard of the average, with twice the bytes
    5.3   all-gathered into a buffer of its own, waited for, and copied: two full buffers, a blocking prefetch
    6.1   the reduce-scatter waited for in the hook that issued it: backward stops at every unit
    6.2   every unit's all-gather started by the first hook of backward: the whole model unsharded at once

Every test that checks values passes under each of them (NUMERICAL_FAILURES is empty); each entry below
names the mechanism test that catches it.
"""

NUMERICAL_FAILURES: dict[str, list[str]] = {}  # exercise -> tests that check values and fail under its bypass

# exercise -> the mechanism tests that must fail under its bypass, on an assertion (check.py --quick runs these;
# a test run for every world size is named at N = 2, the smallest that communicates: the full run has the rest)
CAUGHT_BY: dict[str, list[str]] = {
    "1.1": ["tests/test_ch01_ddp.py::test_all_reduce_by_parts_is_one_reduce_scatter_and_one_all_gather[2]"],
    "1.2": ["tests/test_ch01_ddp.py::test_bucket_all_reduces_are_asynchronous[2]"],
    "1.3": ["tests/test_ch01_ddp.py::test_averages_are_copied_into_the_gradients_autograd_made[2]"],
    "1.4": ["tests/test_ch01_ddp.py::test_several_buckets_go_out_while_backward_runs[2]",
            "tests/test_ch01_ddp.py::test_each_bucket_stays_within_the_cap"],
    "3.1": ["tests/test_ch03_oss.py::test_largest_share_is_within_four_thirds_of_the_best_possible[1-1-2-on-2]"],
    "3.2": ["tests/test_ch03_oss.py::test_each_owner_broadcasts_its_parameters_as_one_flat_tensor[2]"],
    "3.3": ["tests/test_ch03_flat.py::test_bytes_per_step_are_ddps_up_to_padding[sgd-2]"],
    "4.1": ["tests/test_ch04_sdp.py::test_a_bucket_sent_holds_no_gradient_on_any_rank[2]"],
    "4.2": ["tests/test_ch04_flat.py::test_bytes_per_step_are_ddps_up_to_padding[2]",
            "tests/test_ch04_flat.py::test_each_reduce_scatter_is_waited_for_only_once_the_next_bucket_is_computed[2]"],
    "4.3": ["tests/test_ch04_sdp.py::test_gradients_waiting_to_be_sent_stay_within_one_cap[2]"],
    "5.1": ["tests/test_ch05_flat_param.py::test_a_rank_keeps_only_its_shard[2]"],
    "5.2": ["tests/test_ch05_flat_param.py::test_the_average_is_one_reduce_scatter[2]"],
    "5.3": ["tests/test_ch05_flat_param.py::test_unshard_is_one_async_all_gather_into_the_buffer[2]"],
    "6.1": ["tests/test_ch06_fsdp.py::test_each_reduce_scatter_travels_while_the_next_unit_computes"],
    "6.2": ["tests/test_ch06_fsdp.py::test_backward_unshards_each_unit_just_before_its_own_compute"],
}  # exercise -> tests that check values and fail under its bypass

BYPASSES = {
    # A plain all-reduce: the right sum, but not built from its two halves.
    # Caught by test_ch01_ddp.py::test_all_reduce_by_parts_is_one_reduce_scatter_and_one_all_gather.
    "1.1": '''\
result = flat.clone()
comm.all_reduce(result, group=group)
''',

    # A blocking all-reduce in the hook: backward stops for the network at every bucket, nothing overlaps.
    # Caught by test_ch01_ddp.py::test_bucket_all_reduces_are_asynchronous.
    "1.2": '''\
bucket.flat = self._flatten(bucket)
bucket.handle = comm.all_reduce(bucket.flat, async_op=True, tag=f"bucket{self._next}", group=self.process_group)
bucket.handle.wait()
''',

    # A new tensor per parameter instead of copying the average into the .grad autograd made.
    # Caught by test_ch01_ddp.py::test_averages_are_copied_into_the_gradients_autograd_made.
    "1.3": '''\
bucket.handle.wait()
offset = 0
for p in bucket.params:
    average = bucket.flat[offset: offset + p.numel()].view_as(p)
    offset += p.numel()
    if p.grad is not None or globally_used is None or globally_used[p]:
        p.grad = average.to(p.dtype, copy=True)
''',

    # One bucket per dtype and device, the cap ignored: the same averages, in the fewest calls, but the one
    # bucket completes with the last gradient, so nothing travels while backward still computes.
    # Caught by test_ch01_ddp.py::test_several_buckets_go_out_while_backward_runs and
    # ::test_each_bucket_stays_within_the_cap.
    "1.4": '''\
groups = {}
for p in params:
    groups.setdefault((p.dtype, p.device), []).append(p)
position = {id(p): i for i, p in enumerate(params)}
return sorted(groups.values(), key=lambda group: position[id(group[-1])])
''',
    # Greedy, but in registration order: each parameter still goes to the least-loaded rank, but without
    # sorting largest first the shares end up uneven. Every partition gives the same numbers.
    # Caught by test_ch03_oss.py::test_largest_share_is_within_four_thirds_of_the_best_possible (and
    # ::test_partition_balances at N = 3).
    "3.1": '''\
for p in group["params"]:
    rank = sizes.index(min(sizes))
    owned[rank].append(p)
    sizes[rank] += p.numel()
''',

    # One broadcast per parameter instead of one flat tensor per owner (and bucket): the same bytes, in
    # as many calls as there are parameters.
    # Caught by test_ch03_oss.py::test_each_owner_broadcasts_its_parameters_as_one_flat_tensor.
    "3.2": '''\
for p in params:
    if owner == self.rank:
        piece = p.detach().reshape(-1).to(wire)
    else:
        piece = p.new_empty(p.numel(), dtype=wire)
    comm.broadcast(piece, src=owner, tag=f"params of rank {owner}", group=self.group)
    if owner != self.rank or wire != p.dtype:
        p.copy_(piece.view_as(p))
''',
    # All-reduce every bucket's full gradients, then keep this rank's slice: the same average, for twice
    # the bytes of the reduce-scatter the lesson is about.
    # Caught by test_ch03_flat.py::test_bytes_per_step_are_ddps_up_to_padding.
    "3.3": '''\
for b in self.buckets:
    if self.grad_reduction is GradReduction.IN_STEP:
        full = b.flat_grad(1.0 / self.world_size)
        comm.all_reduce(full, tag="grads", group=self.group)
        b.shard.grad = full[b.start: b.start + b.shard.numel()].clone()
    elif b.shard.grad is None:
        b.shard.grad = torch.zeros_like(b.shard)
self._local.step()
for b in self.buckets:
    if self.broadcast_fp16:
        self._all_gather_in_fp16(b)
    else:
        comm.all_gather(b.flat, b.shard, tag="params", group=self.group)
''',
    # Drop the gradients only where they are sent away: the owner keeps its own until the write-back
    # replaces them, a whole share of gradient memory held through backward for nothing.
    # Caught by test_ch04_sdp.py::test_a_bucket_sent_holds_no_gradient_on_any_rank.
    "4.1": '''\
bucket.flat = self._flatten(bucket, release=bucket.owner != self.rank)
bucket.handle = comm.reduce(bucket.flat, dst=bucket.owner, async_op=True, tag=f"bucket{self._next}",
                            group=self.process_group)
if bucket.owner != self.rank:
    self._sent.append(bucket)
''',
    # All-reduce the bucket and keep this rank's slice, waiting for it at once: the same average, for twice
    # the bytes, and backward stops for the network at every bucket.
    # Caught by test_ch04_flat.py::test_bytes_per_step_are_ddps_up_to_padding and
    # ::test_each_reduce_scatter_is_waited_for_only_once_the_next_bucket_is_computed.
    "4.2": '''\
flat = layout.flat_grad(1.0 / self.world_size, self.reduce_dtype, release=True)
handle = comm.all_reduce(flat, async_op=True, tag=f"bucket{self._next}", group=self.process_group)
handle.wait()
chunk = flat[layout.start: layout.start + layout.shard.numel()].clone()
self._in_flight.append((layout, chunk, flat, handle))
''',
    # Owner buckets with a whole cap each, as DDP's _pack would cut every owner's parameters: one owner and
    # one dtype per bucket, so every value is right, but each owner's open bucket may fill up to a cap before
    # it goes, and N of them wait together.
    # Caught by test_ch04_sdp.py::test_gradients_waiting_to_be_sent_stay_within_one_cap.
    "4.3": '''\
open_buckets, sizes, groups = {}, {}, []
for p in reversed(params):
    key = (owner[p], p.dtype, p.device)
    nbytes = p.numel() * p.element_size()
    if key in open_buckets and sizes[key] + nbytes > self._cap:
        groups.append(open_buckets.pop(key))
        del sizes[key]
    open_buckets.setdefault(key, []).append(p)
    sizes[key] = sizes.get(key, 0) + nbytes
groups.extend(open_buckets.values())
''',
    # The shard cut from a full-size copy: the right values, but every rank keeps a storage of the whole
    # padded unit behind its "shard" -- the memory ZeRO-3 exists to save.
    # Caught by test_ch05_flat_param.py::test_a_rank_keeps_only_its_shard.
    "5.1": '''\
align = max(1, ALIGN_BYTES // params[0].element_size())
self.offsets, padded_numel = flat_layout(self.numels, self.world_size, align)
self.shard_numel = padded_numel // self.world_size
padded = torch.zeros(padded_numel, dtype=params[0].dtype, device=params[0].device)
for p, offset in zip(params, self.offsets):
    padded[offset: offset + p.numel()].copy_(p.detach().reshape(-1))
start = self.rank * self.shard_numel
shard = padded.clone()[start: start + self.shard_numel]
''',

    # An all-reduce of the whole flat gradient, this rank's slice kept: the same average for twice the bytes.
    # Caught by test_ch05_flat_param.py::test_the_average_is_one_reduce_scatter.
    "5.2": '''\
full_grad.mul_(1.0 / self.world_size)
start = self.rank * self.shard_numel
grad_shard = full_grad[start: start + self.shard_numel]
handle = comm.all_reduce(full_grad, async_op=True, tag=f"reduce_scatter {self.name}", group=self.group)
''',

    # All-gather into a buffer of its own, wait for it at once, and copy it into the full buffer: the right
    # parameters, but two full buffers at the peak, and a prefetch that blocks.
    # Caught by test_ch05_flat_param.py::test_unshard_is_one_async_all_gather_into_the_buffer.
    "5.3": '''\
_alloc_storage(self._full)
self._all_gather_input = self.all_gather_input()
gathered = torch.empty_like(self._full)
self._unshard_handle = comm.all_gather(gathered, self._all_gather_input, async_op=True,
                                       tag=f"unshard {self.name}", group=self.group)
self._unshard_handle.wait()
self._full.copy_(gathered)
''',
    # The reduce-scatter waited for at once, in the hook that issued it: the right shards, but backward
    # stops for the network at every unit.
    # Caught by test_ch06_fsdp.py::test_each_reduce_scatter_travels_while_the_next_unit_computes.
    "6.1": '''\
full_grad = flat.param.grad
flat.param.grad = None
handle, grad_shard = flat.reduce_scatter_grad(full_grad)
handle.wait()
self.root_state.pending.append((flat, handle, grad_shard, full_grad))
self._reshard([flat])
self.root_state.retire_finished()
''',

    # Every unit's all-gather started by the first hook of backward: the same bytes and values, but every
    # unit's full parameters are alive at once, from the start of backward -- a ZeRO-3 that keeps all of them.
    # Caught by test_ch06_fsdp.py::test_backward_unshards_each_unit_just_before_its_own_compute.
    "6.2": '''\
if not state.callback_queued:
    state.callback_queued = True
    torch.autograd.Variable._execution_engine.queue_callback(state.root.finish_backward)
    for unit in state.root.units():
        unit._start_unshard()
self._start_unshard()
''',
}
