"""Test helper: a list that refuses slicing, to show a hot path reads a list in place."""


class NoSlices(list):
    """A list whose slicing raises (a slice copies: what a path that reads in place never does)."""

    def __getitem__(self, i):
        if isinstance(i, slice):
            raise AssertionError("list sliced")
        return super().__getitem__(i)
