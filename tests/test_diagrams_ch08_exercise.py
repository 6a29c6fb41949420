"""What exercise 8.1's contract figure (cast_shard_contract, chapters/diagrams/ch08_precision.py) shows is what
the package counts: one unshard of a Block unit of the default GPT at N = 4, in fp32 and bf16, with and without
offload (its all-gathers, the bytes on the wire, the bytes copied host_to_device), and the two wrong designs'
numbers: a shard cast on the host and copied in bf16 (a patched _cast_shard), the fp32 shards gathered (the fp32
run's bytes). (tests/test_diagrams.py checks that the SVG is what the script draws, and legible.)
"""

import pytest

torch = pytest.importorskip("torch")

from minifsdp import comm, launch  # noqa: E402
from minifsdp.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from minifsdp.fsdp import ModuleWrapPolicy  # noqa: E402
from minifsdp.fsdp.precision import MixedPrecisionFlatParameter  # noqa: E402
from minifsdp.mixed_precision import CPUOffload, MixedPrecision  # noqa: E402
from minifsdp.models import Block, TinyGPT  # noqa: E402

from diagram_modules import diagram_module  # noqa: E402

ch08 = diagram_module("ch08_precision")


def _cast_on_the_host(self):  # a wrong design: the copy carries bf16
    return comm.copy_to(self._shard.to(self.param_dtype), self._full.device, "host_to_device")


def _one_unshard_of_a_block():
    """Rank 0's counters for one unshard of the first Block unit, in each of the figure's runs."""
    out = {}
    runs = [(dtype, offload, False) for dtype, offload, *_ in ch08.CAST_RUNS] + [("bf16", True, True)]
    for dtype, offload, wrong in runs:
        kw = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)} if dtype == "bf16" else {}
        if offload:
            kw["cpu_offload"] = CPUOffload(offload_params=True)
        model = FSDP(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
        unit = next(u for u in model.units() if isinstance(u.module, Block))
        (flat,) = unit.flat_params
        original = MixedPrecisionFlatParameter._cast_shard
        if wrong:
            MixedPrecisionFlatParameter._cast_shard = _cast_on_the_host
        try:
            with comm.counting() as counter:
                flat.unshard()
        finally:
            MixedPrecisionFlatParameter._cast_shard = original
        flat.reshard()
        out[dtype, offload, wrong] = (flat.shard_numel, flat._full.numel(), dict(counter.calls),
                                      dict(counter.bytes), dict(counter.copies))
    return out


@pytest.fixture(scope="module")
def counted():
    return launch(_one_unshard_of_a_block, world_size=ch08.CAST_N, device="cpu")[0]


def test_the_figure_s_unshards_are_what_comm_counts(counted):
    for dtype, offload, calls, wire, copied in ch08.CAST_RUNS:
        shard, padded, got_calls, got_bytes, got_copies = counted[dtype, offload, False]
        assert (shard, padded) == (ch08.CAST_SHARD_NUMEL, ch08.CAST_PADDED_NUMEL)
        assert got_calls == {"all_gather": calls}, (dtype, offload)
        assert got_bytes == {"all_gather": wire}, (dtype, offload)
        assert got_copies == ({"host_to_device": copied} if copied else {}), (dtype, offload)
        itemsize = 2 if dtype == "bf16" else 4
        assert wire == itemsize * padded * (ch08.CAST_N - 1) / ch08.CAST_N  # the contract's formula
        assert copied == (4 * shard if offload else 0)


def test_the_wrong_designs_numbers():
    # gathering the fp32 shards and casting afterwards puts the fp32 run's bytes on the wire
    wire = {(d, o): b for d, o, _, b, _ in ch08.CAST_RUNS}
    assert wire["fp32", True] == 2 * wire["bf16", True]


def test_a_shard_cast_on_the_host_copies_half_the_bytes(counted):
    *_, got_bytes, got_copies = counted["bf16", True, True]
    assert got_copies == {"host_to_device": 2 * ch08.CAST_SHARD_NUMEL}  # the figure's second red box
    assert got_bytes == {"all_gather": ch08.CAST_RUNS[3][3]}  # the wire cannot tell
