"""extractor._machine: the thread counts and depths made from a machine's CPUs and memory, and the setting that
overrides its CPUs."""

from __future__ import annotations

import os

import pytest

from extractor._machine import CPUS_VARIABLE, Machine
from extractor.errors import SpecError

GIB = 1 << 30


def test_a_2_core_machine_keeps_the_constants_it_was_tuned_with():
    m = Machine(cpus=2, memory=24 * GIB)
    assert m.write_threads == 4 and m.write_queue(1 << 20) == 4  # WRITE_THREADS and WRITE_QUEUE before
    assert m.index_lanes(64 << 20) == 2 and m.read_ahead == 2  # LANES and READ_AHEAD before
    assert m.decode_ahead(batch_size=32, threads=2, batch_bytes=32 * 150_528) == 2  # prefetch_batches before


def test_a_16_core_node_gets_more_of_each_within_its_memory():
    m = Machine(cpus=16, memory=128 * GIB)
    assert m.write_threads == 8
    assert m.write_queue(24 << 20) == 8  # a chunk per writer thread: 24 MiB each (24 ViT-L blocks) fits
    assert m.index_lanes(64 << 20) == 16
    assert m.decode_ahead(batch_size=32, threads=16, batch_bytes=32 * 150_528) == 2  # each thread 4 images ahead
    assert m.decode_ahead(batch_size=8, threads=16, batch_bytes=8 * 150_528) == 8


def test_memory_bounds_the_queues_and_the_lanes():
    small = Machine(cpus=16, memory=1 * GIB)  # 64 MiB for a queue, a read-ahead, the lanes' blocks
    assert small.write_queue(24 << 20) == 2 and small.write_queue(1 << 30) == 1  # one at least
    assert small.index_lanes(64 << 20) == 1
    assert small.decode_ahead(batch_size=8, threads=16, batch_bytes=40 << 20) == 2  # never below 2


def test_extractor_cpus_overrides_the_cpus_and_a_bad_value_is_one_line(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(CPUS_VARIABLE, "16")
    assert Machine.here().cpus == 16 and Machine.here(cpus=3).cpus == 16
    monkeypatch.delenv(CPUS_VARIABLE)
    assert Machine.here(cpus=3).cpus == 3
    assert Machine.here().cpus == len(os.sched_getaffinity(0))
    assert Machine.here().memory > 0
    for bad in ("0", "two", "-4", "1.5"):
        monkeypatch.setenv(CPUS_VARIABLE, bad)
        with pytest.raises(SpecError, match=f"EXTRACTOR_CPUS='{bad}': expected a whole number of CPUs"):
            Machine.here()
