"""The OpenMP waiting local llama.cpp processes start with: a short spin only where they share cores."""

from __future__ import annotations

import pytest

from engines.openmp_wait import SHORT_SPIN_ENV, openmp_wait_env, processes_share_cores


def test_three_nodes_of_two_threads_on_two_cores_spin_briefly():
    assert openmp_wait_env(3, 2, 2, others=1) == {"GOMP_SPINCOUNT": "1000"}


def test_three_nodes_of_two_threads_on_sixteen_cores_keep_libgomps_own_spin():
    assert openmp_wait_env(3, 2, 16, others=1) == {}


@pytest.mark.parametrize(("cpus", "shared"), [(9, True), (10, False)])
def test_each_process_needs_its_threads_and_an_event_loop_and_the_others_count_too(cpus, shared):
    # 3 x (2 threads + 1 event loop) + 1 other busy thread = 10.
    assert processes_share_cores(3, 2, cpus, others=1) is shared


def test_processes_of_all_the_cores_share_them_however_many_there_are():
    assert processes_share_cores(2, None, 256) is True


@pytest.mark.parametrize("threads", [None, 1, 64])
def test_one_process_alone_keeps_its_spin_whatever_its_threads(threads):
    # Its own spinning threads take no core another llama.cpp process needs.
    assert openmp_wait_env(1, threads, 1, others=1) == {}


def test_the_answer_is_a_copy_a_caller_may_extend():
    env = openmp_wait_env(3, 2, 2)
    env["MESHNODE_WEIGHT_REPACK"] = "off"
    assert SHORT_SPIN_ENV == {"GOMP_SPINCOUNT": "1000"}
