"""The suite's file order (tests/suite_order.py LONGEST_FIRST, LAST) names files that exist: a
file renamed or removed there would silently fall back to running in collection order."""

from pathlib import Path

from suite_order import LAST, LONGEST_FIRST, longest_files_first

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_file_exists_once():
    listed = LONGEST_FIRST + LAST
    assert len(set(listed)) == len(listed)
    missing = [path for path in listed if not (ROOT / path).is_file()]
    assert not missing, f"LONGEST_FIRST or LAST names files that are gone: {missing}"


def test_listed_files_go_first_in_their_order_the_rest_keep_theirs_and_last_go_last():
    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    ids = [f"{LAST[0]}::t0", "tests/core/test_a.py::t1", f"{LONGEST_FIRST[1]}::t2",
           "tests/test_b.py::t3", f"{LONGEST_FIRST[0]}::t4", f"{LONGEST_FIRST[1]}::t5",
           "tests/core/test_a.py::t6"]
    items = [Item(i) for i in ids]
    longest_files_first(items)
    assert [i.nodeid for i in items] == [ids[4], ids[2], ids[5], ids[1], ids[3], ids[6],
                                         ids[0]]
