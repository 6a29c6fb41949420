"""A module's rank results by world size, launched when a test first asks for them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping


class PerWorldSize(Mapping):
    """`ranks[n]` is `make(n)`, run the first time a test reads it and kept for the module's other tests.

    Eager, `{n: launch(...) for n in WORLD_SIZES}`, a run of one test for one world size (the grader's
    mechanism checks, `pytest -k`, a bisection) would start the ranks of every world size first. A launch
    that fails fails every test that asks for it, as a failing module fixture would, without running again.
    """

    def __init__(self, make: Callable[[int], object], sizes: Iterable[int]):
        self._make, self._sizes, self._done = make, tuple(sizes), {}

    def __getitem__(self, n: int):
        if n not in self._sizes:
            raise KeyError(n)
        if n not in self._done:
            try:
                self._done[n] = (True, self._make(n), None)
            except Exception as e:  # noqa: BLE001 -- kept, to be raised again for the next test that asks
                self._done[n] = (False, e, e.__traceback__)
        ok, value, traceback = self._done[n]
        if not ok:
            # From its first traceback each time: raised as it is, the exception would collect every earlier
            # test's frames, and a report of hundreds of failures would take minutes to write.
            raise value.with_traceback(traceback)
        return value

    def __iter__(self):
        return iter(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)
