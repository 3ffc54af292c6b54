"""The exactly-once and kill-point tests that run with ``workers=2``, again
with ``tls=True`` on every Environment they make: the exchange between the
workers is mutual TLS (the job's CA, one certificate per attempt) and the
results are the same. One seed per checkpoint mode by default;
``PYFLOWBUF_WORKER_KILLS=N`` runs N seeds of each."""
import multiprocessing
import os
import random

import pytest

import pyflowbuf as fb
import test_checkpoints
import test_checkpoints_workers
import test_cluster
import test_unaligned

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork")]

SEEDS = range(int(os.environ.get("PYFLOWBUF_WORKER_KILLS", "0")) or 1)
STAGES = ["forward", "rebalance", "key_by", "union"]


@pytest.fixture(autouse=True)
def tls_everywhere(monkeypatch):
    """Every Environment the reused tests make has tls=True; afterwards each
    job that ran used it (a TLSConfig per attempt, a new one after a restart)."""
    made = []
    init = fb.Environment.__init__

    def with_tls(self, *args, **kw):
        kw.setdefault("tls", True)
        init(self, *args, **kw)
        made.append(self)
    monkeypatch.setattr(fb.Environment, "__init__", with_tls)
    yield
    ran = [env.last_execution for env in made if env.last_execution is not None]
    assert ran
    for ex in ran:
        configs = [ex.tls.for_attempt(a) for a in range(ex.attempt + 1)]
        assert all(c is not None for c in configs)
        assert len({c.fingerprints for c in configs}) == len(configs)      # one certificate per attempt


def _args(seed, kill_range):
    rng = random.Random(seed)
    return dict(stages=[rng.choice(STAGES) for _ in range(rng.randint(1, 3))], fail_stage=rng.randint(0, 2),
                kill_at=rng.randint(*kill_range))


@pytest.mark.parametrize("seed", SEEDS)
def test_aligned_worker_kill_with_tls(tmp_path_factory, seed):
    test_checkpoints.test_exactly_once_when_a_worker_process_is_killed_at_a_random_record.hypothesis.inner_test(
        tmp_path_factory, **_args(seed, (1, 1400)))


@pytest.mark.parametrize("mode", [dict(checkpoint_alignment="unaligned"),
                                  dict(checkpoint_alignment="unaligned", alignment_timeout=0.005)],
                         ids=["unaligned", "alignment-timeout"])
@pytest.mark.parametrize("seed", SEEDS)
def test_unaligned_worker_kill_with_tls(tmp_path_factory, seed, mode):
    test_unaligned.test_exactly_once_when_a_worker_is_killed_unaligned.hypothesis.inner_test(
        tmp_path_factory, mode=mode, **_args(seed, (200, 2500)))


@pytest.mark.parametrize("where", ["stage", "after"])
def test_killed_worker_recovered_exactly_once_with_tls(tmp_path, where):
    test_checkpoints_workers.test_a_killed_worker_process_is_recovered_exactly_once(tmp_path, where)


@pytest.mark.parametrize("where", ["stage", "after"])
def test_exception_in_a_worker_recovered_exactly_once_with_tls(tmp_path, where):
    test_checkpoints_workers.test_an_exception_in_a_worker_is_recovered_exactly_once(tmp_path, where)


def test_collect_across_workers_with_tls():
    test_cluster.test_collect_across_workers_is_exactly_once()
