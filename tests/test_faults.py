"""Whose fault an error is (extractor.faults), decided alone, without a pipeline around it."""

from __future__ import annotations

import pytest
import torch

from extractor.errors import DeviceError, FencedError, LayerError, ShardError
from extractor.faults import blame, device_fault, not_an_image, shard_failed, whose


class Callback(Exception):
    pass


@pytest.mark.parametrize(("err", "verdict"), [
    (ValueError("a decoder bug"), "this"),  # raised while shard 3 ran: shard 3's failure
    (ShardError("shard 3 failed", 3), "as_is"),  # already shard 3's
    (ShardError("shard 2 failed", 2), "another"),  # the shard before, read back late: 3 goes back to the queue
    (ShardError("no shard", None), "another"),
    (FencedError("another job holds the store"), "as_is"),  # the job's: raised as it is
    (Callback("the caller's"), "as_is"),
    (KeyboardInterrupt(), "as_is"),
])
def test_blame_names_the_shard_at_fault(err: BaseException, verdict: str):
    assert blame(err, 3, passes=(Callback,)) == verdict


def test_a_shard_failure_names_the_shard_its_rows_and_the_cause():
    err = shard_failed(3, 30, 40, OSError("disk full"))
    assert err.shard == 3 and str(err) == "shard 3 (rows 30-39) failed: OSError: disk full"


def test_the_driver_stops_the_job_for_a_fenced_writer_a_shard_for_its_error_and_replaces_the_worker_otherwise():
    assert whose(FencedError("x")) == "job"
    assert whose(ShardError("x", 1)) == "shard"
    assert whose(DeviceError("cuda")) == "worker" and whose(RuntimeError("x")) == "worker"


def test_a_device_fault_is_found_behind_the_errors_that_wrap_it_and_is_never_an_images():
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is None:
        pytest.skip("this torch has no AcceleratorError")
    fault = accelerator("CUDA error: an illegal memory access was encountered")
    with pytest.raises(ShardError) as outer:  # noqa: PT012 - the chain as a worker raises it
        try:
            raise fault
        except accelerator as inner:
            raise ShardError("shard 1 failed", 1) from inner
    assert device_fault(outer.value) is fault
    assert device_fault(ValueError("x")) is None
    assert accelerator in not_an_image() and LayerError in not_an_image()


def test_an_error_that_says_to_make_the_store_again_crosses_processes_whole():
    """A RemakeError (and a CountError) pickled and read back (a listing process's, a Ray job's) keeps its message,
    what the store was made for (the CLI's --overwrite line) and what the session marked on it."""
    import pickle

    from extractor.errors import CountError, RemakeError

    late = RemakeError("row 9: label 'emu' is a class name", "labels taken as class indices")
    late.creating = True  # type: ignore[attr-defined]
    for err, made_for in ((late, "labels taken as class indices"), (CountError("3 rows, 4 listed"),
                                                                   "the rows counted first")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.made_for == made_for
    assert pickle.loads(pickle.dumps(late)).creating is True
