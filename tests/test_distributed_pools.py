"""tests/distributed.py's worker limit: kept pools and run_on_ranks' fresh workers together never
exceed MAX_POOL_WORKERS (each worker holds about 1 GiB), and a pool the running test took is never
closed under it. A stand-in pool records the live workers instead of spawning them."""

import distributed
import pytest


class CountingPool:
    """Stands in for DistributedPool: no workers, only the count of live ones."""

    live = 0
    most = 0

    def __init__(self, tp=1, cp=1, dp=1, pp=1, vp=None, *, megatron=True):
        self.world_size = tp * cp * dp * pp
        CountingPool.live += self.world_size
        CountingPool.most = max(CountingPool.most, CountingPool.live)
        self.closed = False

    def run(self, fn, *args):
        return [fn(distributed.RankInfo(rank, self.world_size, 0, 1, 0, 1, rank, self.world_size), *args)
                for rank in range(self.world_size)]

    def close(self):
        CountingPool.live -= 0 if self.closed else self.world_size
        self.closed = True


@pytest.fixture
def pools(monkeypatch):
    monkeypatch.setattr(distributed, "DistributedPool", CountingPool)
    monkeypatch.setattr(distributed, "_POOLS", {})
    monkeypatch.setattr(CountingPool, "live", 0)
    monkeypatch.setattr(CountingPool, "most", 0)
    return distributed._POOLS


def test_fresh_ranks_make_room_among_the_kept_pools(pools):
    distributed.begin_test()
    kept = distributed.get_pool(tp=2, cp=2, dp=2)  # 8 workers: the whole limit
    distributed.begin_test()
    assert distributed.run_on_ranks(4, lambda rank, world_size: (rank, world_size)) == [(r, 4) for r in range(4)]
    assert kept.closed and not pools and CountingPool.live == 0
    assert CountingPool.most == distributed.MAX_POOL_WORKERS


def test_a_pool_the_running_test_took_is_kept(pools):
    distributed.begin_test()
    taken = distributed.get_pool(tp=2, dp=2)
    other = distributed.get_pool(tp=2, cp=2)
    distributed.run_on_ranks(2, lambda rank, world_size: rank)
    assert not taken.closed and not other.closed  # both taken by this test: the limit yields to it
