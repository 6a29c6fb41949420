"""Chapter 9's diagrams (chapters/diagrams/ch09_training.py): the deferred-init memory picture follows the rule
tests/test_ch09_training.py holds the real peak to, and the names the pictures use are the code's."""

import re
from pathlib import Path
from diagram_modules import diagram_module

REPO = Path(__file__).resolve().parents[1]


d = diagram_module("ch09_training")


def _peak(deferred):
    return max(v for _, steps in d._init_profile(deferred) for v in steps)


def test_deferred_init_peaks_as_the_test_of_the_package_says():
    """While unit k is built a rank holds the shards of the units before it, unit k's parameters, its flat copy
    and its shard (test_deferred_init_holds_one_unit_in_full_at_a_time): the largest such sum, in units."""
    n, units = d.INIT_N, d.INIT_UNITS
    assert _peak(True) == max(k / n + 1 + 1 + 1 / n for k in range(units))
    # eager: the whole model, then the first unit's flat copy and shard on top of it
    assert _peak(False) == units + 1 + 1 / n
    assert _peak(True) < units < _peak(False)  # below the whole model: a model larger than a rank can be built
    for deferred in (False, True):  # and both end with every unit's shard, nothing else
        assert d._init_profile(deferred)[-1][1][-1] == units / n


def test_the_names_the_pictures_use_are_the_code_s():
    source = "".join((REPO / path).read_text(encoding="utf-8") for path in
                     ("minifsdp/fsdp/training.py", "minifsdp/zero/clip.py", "minifsdp/fsdp/fsdp1/model.py",
                      "minifsdp/distributed/comm.py"))
    drawn = "".join((REPO / "chapters" / "figures" / "diagrams" / f"{f.__name__}.svg").read_text(encoding="utf-8")
                    for f in d.DIAGRAMS)
    for name in ("no_sync", "param_init_fn", "clip_grad_norm_", "reduce_scatter", "all_reduce", "max_norm", "1e-6"):
        assert re.search(re.escape(name), source), f"the package has no {name}"
        assert name in drawn, f"no picture of chapter 9 uses {name} any more: drop it from this list"
