"""The shared test helpers fail loudly: a wait that passed without its
condition, or a cancel that hid a failure, would weaken every test using it."""
import subprocess
import sys
import types

import pytest

import pyflowbuf as fb
from pipeline_helpers import cancel_and_join, wait_for


def test_wait_for_returns_the_value_and_names_what_never_came():
    calls = []
    assert wait_for(lambda: calls.append(1) or (len(calls) >= 3 and "ready"), "three calls") == "ready"
    with pytest.raises(AssertionError, match=r"timed out after 0.1 s waiting for the sky to fall"):
        wait_for(lambda: False, "the sky to fall", timeout=0.1)
    with pytest.raises(AssertionError, match=r"waiting for state 7"):
        wait_for(lambda: False, lambda: f"state {7}", timeout=0.05)


def test_wait_for_stops_when_the_process_or_the_job_has_ended():
    proc = subprocess.Popen([sys.executable, "-c", "print('bye')"], stdout=subprocess.PIPE, text=True)
    with pytest.raises(AssertionError, match=r"the process ended before a checkpoint: \('bye"):
        wait_for(lambda: False, "a checkpoint", proc=proc)
    with pytest.raises(AssertionError, match="the job ended before output"):
        wait_for(lambda: False, "output", job=types.SimpleNamespace(done=True))


def test_cancel_and_join_reports_a_failure_unless_told_it_is_expected():
    def boom(x):
        raise ValueError("boom")

    for failure_ok in (False, True):
        env = fb.Environment()
        env.from_sequence(0, None).map(boom).sink(lambda x: None)
        job = env.execute_async()
        wait_for(lambda: job.done, "the job to fail")
        if failure_ok:
            cancel_and_join(job, failure_ok=True)
        else:
            with pytest.raises(fb.errors.JobFailedError, match="boom"):
                cancel_and_join(job)
