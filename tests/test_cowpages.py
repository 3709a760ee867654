"""memory/cowpages.py: in a lazy view, a page a child shares with its parent (PE_COW) is lazy
exactly where the parent's page is, so a page server (which holds lazy pages) or the view's own
pages (the eager ones) always has what CRIU asks for.  Logic on pagemap entries; the carried CRIU
writing and reading PE_COW is tests/test_criu_carried.py."""

from __future__ import annotations

import pytest

from pitstop.memory.cowpages import like_parents, make_eager, merge
from pitstop.memory.dumpview import PAGE, PE_COW, PE_LAZY, PE_PARENT, PE_PRESENT

LAZY = PE_PRESENT | PE_LAZY


def e(va_page: int, n: int, flags: int) -> dict:
    return {"vaddr": va_page * PAGE, "compat_nr_pages": 0, "nr_pages": n, "flags": flags}


def pages(entries: list[dict], flags: int) -> set[int]:
    """The page numbers of entries whose flags include all of `flags`."""
    return {int(x["vaddr"]) // PAGE + i for x in entries if int(x["flags"]) & flags == flags
            for i in range(int(x["nr_pages"]))}


def test_merge_joins_touching_and_overlapping_spans():
    assert merge([(10, 20), (0, 5), (5, 8), (15, 30)]) == [(0, 8), (10, 30)]


def test_make_eager_cuts_entries_at_the_spans_and_keeps_every_page_once():
    entries = [e(0, 10, LAZY), e(10, 4, PE_PRESENT), e(20, 10, PE_PARENT | PE_LAZY), e(40, 2, PE_LAZY)]
    out, made = make_eager(entries, [(2 * PAGE, 5 * PAGE), (8 * PAGE, 25 * PAGE)])
    assert pages(out, 0) == pages(entries, 0)  # no page lost or doubled
    assert sum(int(x["nr_pages"]) for x in out) == sum(int(x["nr_pages"]) for x in entries)
    assert pages(out, PE_LAZY) == {0, 1, 5, 6, 7, *range(25, 30), 40, 41}  # lazy without pages: untouched
    assert made == 3 + 2 + 5
    # the pages file order holds: present entries stay in address order
    assert [int(x["vaddr"]) for x in out] == sorted(int(x["vaddr"]) for x in out)


def test_a_shared_page_is_lazy_only_where_the_parents_page_is():
    tasks = {
        1: [e(0, 50, LAZY), e(50, 50, PE_PRESENT)],  # the rank: its pages 50-99 are placed by the restore
        2: [e(0, 100, PE_COW | PE_LAZY)],  # a worker sharing all of them
    }
    out = like_parents(tasks, {1: 0, 2: 1})
    assert pages(out[2][0], PE_COW | PE_LAZY) == set(range(50))
    assert pages(out[2][0], PE_COW) == set(range(100))
    assert pages(out[1][0], PE_LAZY) == set(range(50))  # the rank's marks stand
    assert out[1][1] == 0 and out[2][1] == 50


def test_a_shared_stack_page_makes_the_parents_page_eager_up_to_the_grandparent():
    tasks = {
        1: [e(0, 100, LAZY)],  # the rank
        2: [e(0, 30, PE_COW | PE_LAZY), e(30, 5, LAZY), e(35, 65, PE_COW | PE_LAZY)],  # a worker
        3: [e(0, 10, LAZY), e(10, 2, PE_COW), e(12, 8, PE_COW | PE_LAZY)],  # its child: 10-11 its stack, eager
    }
    out = like_parents(tasks, {1: 0, 2: 1, 3: 2})
    assert pages(out[3][0], PE_COW | PE_LAZY) == set(range(12, 20))
    assert pages(out[3][0], PE_LAZY) == set(range(10)) | set(range(12, 20))
    # the worker places pages 10-11 itself, and so must the rank, whose pages they are
    assert pages(out[2][0], PE_LAZY) == set(range(100)) - {10, 11}
    assert pages(out[1][0], PE_LAZY) == set(range(100)) - {10, 11}
    assert [out[p][1] for p in (1, 2, 3)] == [2, 2, 0]
    for pid, parent in ((2, 1), (3, 2)):  # every shared page lazy in a child is lazy in its parent
        assert pages(out[pid][0], PE_COW | PE_LAZY) <= pages(out[parent][0], PE_LAZY)


def test_a_child_whose_parent_is_not_in_the_dump_is_refused():
    with pytest.raises(ValueError, match="does not hold"):
        like_parents({2: [e(0, 1, PE_COW)]}, {2: 1})
