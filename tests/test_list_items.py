"""A list's item pointers (minipic_jax/list_items.py): equal bytes exactly for the same objects
in the same order; None for what is not a list."""

import pytest

from minipic_jax.list_items import item_bytes


def test_item_bytes_tell_the_same_objects_from_equal_ones():
    ints = [1000 + k for k in range(50)]
    if item_bytes(ints) is None:
        pytest.skip("this interpreter's lists are not read by pointer")
    assert item_bytes(list(ints)) == item_bytes(ints) and len(item_bytes(ints)) == 8 * 50
    assert item_bytes([]) == b""
    ones = [1] * 50
    for k, other in ((3, 1003.0), (4, int(str(1004)))):  # equal values, other objects
        changed = list(ints)
        changed[k] = other
        assert changed == ints and item_bytes(changed) != item_bytes(ints)
    with_bool = list(ones)
    with_bool[7] = True
    assert with_bool == ones and item_bytes(with_bool) != item_bytes(ones)
    assert item_bytes(ints[::-1]) != item_bytes(ints) and item_bytes(ints[:-1]) != item_bytes(ints)
    assert item_bytes(tuple(ints)) is None and item_bytes(range(3)) is None
