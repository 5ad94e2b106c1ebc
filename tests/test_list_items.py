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


@pytest.mark.parametrize("in_place", [True, False])
def test_same_items_compares_a_list_with_remembered_pointers(monkeypatch, in_place):
    """In place (memcmp holding the GIL) or, where the process has no memcmp, copied out: the
    same answer; a list of other objects, another length, or no list at all is not the same."""
    from minipic_jax import list_items
    ints = [1000 + k for k in range(64)]
    kept = list_items.item_bytes(ints)
    if kept is None:
        pytest.skip("this interpreter's lists are not read by pointer")
    if not in_place:
        monkeypatch.setattr(list_items, "_MEMCMP", None)
    same = list_items.same_items
    assert same(list(ints), kept) and same([], b"") and not same([], kept)
    floats = list(ints)
    floats[63] = 1063.0
    assert floats == ints and not same(floats, kept)
    assert not same(ints[:-1], kept) and not same(ints + [5], kept)
    assert not same(tuple(ints), kept) and not same(ints, None)
