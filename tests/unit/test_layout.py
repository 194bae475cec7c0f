"""Exhaustive checks of the rank layout for small sizes, plus every validation error."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from dpserve.contract.layout import (
    AXES,
    Axis,
    LayoutError,
    ParallelConfig,
    RankInfo,
    all_groups,
    describe,
    rank_info,
    rank_of,
    replica_endpoint,
    replica_endpoints,
    replica_ranks,
)

CONFIGS = [
    ParallelConfig(tp=tp, sp=u * r, ulysses=u, ring=r, cfg=cfg, dp=dp)
    for tp, u, r, cfg, dp in itertools.product((1, 2), (1, 2), (1, 2), (1, 2), (1, 2, 3))
]

# Axis name -> RankInfo attribute holding the rank's group along it.
GROUP_ATTR = {axis: f"{axis}_group" for axis in AXES}
# Axis name -> RankInfo coordinates that vary along it; all others are fixed within a group.
VARYING = {
    "tp": {"tp_rank"},
    "ulysses": {"ulysses_rank", "sp_rank"},
    "ring": {"ring_rank", "sp_rank"},
    "sp": {"sp_rank", "ulysses_rank", "ring_rank"},
    "cfg": {"cfg_rank"},
    "replica": {"tp_rank", "sp_rank", "ulysses_rank", "ring_rank", "cfg_rank"},
}
COORDS = ("replica", "tp_rank", "sp_rank", "ulysses_rank", "ring_rank", "cfg_rank")


def infos(config: ParallelConfig) -> list[RankInfo]:
    return [rank_info(config, r) for r in range(config.world_size)]


@pytest.fixture(params=CONFIGS, ids=describe)
def config(request: pytest.FixtureRequest) -> ParallelConfig:
    return request.param  # type: ignore[no-any-return]


def test_sizes(config: ParallelConfig) -> None:
    c = config
    assert c.gang_size == c.tp * c.ulysses * c.ring * c.cfg
    assert c.world_size == c.dp * c.gang_size


def test_ranks_map_to_unique_coordinates_and_back(config: ParallelConfig) -> None:
    seen = set()
    for info in infos(config):
        coords = (info.replica, info.tp_rank, info.sp_rank, info.cfg_rank)
        seen.add(coords)
        assert info.sp_rank == info.ulysses_rank + config.ulysses * info.ring_rank
        assert info.local_rank == info.global_rank - info.replica * config.gang_size
        back = rank_of(
            config,
            replica=info.replica,
            tp_rank=info.tp_rank,
            sp_rank=info.sp_rank,
            cfg_rank=info.cfg_rank,
        )
        assert back == info.global_rank
    assert len(seen) == config.world_size


def test_formula_matches_documented_order(config: ParallelConfig) -> None:
    c = config
    for info in infos(c):
        expected = info.tp_rank + c.tp * (
            info.sp_rank + c.sp * (info.cfg_rank + c.cfg * info.replica)
        )
        assert expected == info.global_rank


@pytest.mark.parametrize("axis", AXES)
def test_groups_partition_world_and_stay_in_replica(config: ParallelConfig, axis: Axis) -> None:
    groups = all_groups(config, axis)
    members = [r for g in groups for r in g]
    assert sorted(members) == list(range(config.world_size))
    # Deterministic order: sorted by lowest member, and stable across calls.
    assert groups == sorted(groups, key=min)
    assert groups == all_groups(config, axis)
    g = config.gang_size
    for group in groups:
        assert len({r // g for r in group}) == 1, f"{axis} group {group} crosses replicas"
        assert list(group) == sorted(group)
        # Members differ only in the coordinates of this axis.
        fixed = [c for c in COORDS if c not in VARYING[axis]]
        ranks = [rank_info(config, r) for r in group]
        assert len({tuple(getattr(i, c) for c in fixed) for i in ranks}) == 1


def test_rank_groups_contain_rank_and_match_all_groups(config: ParallelConfig) -> None:
    by_axis = {axis: set(all_groups(config, axis)) for axis in AXES}
    for info in infos(config):
        for axis, attr in GROUP_ATTR.items():
            group = getattr(info, attr)
            assert info.global_rank in group
            assert group in by_axis[axis]
        assert len(info.tp_group) == config.tp
        assert len(info.sp_group) == config.sp
        assert len(info.ulysses_group) == config.ulysses
        assert len(info.ring_group) == config.ring
        assert len(info.cfg_group) == config.cfg
        assert info.replica_group == tuple(replica_ranks(config, info.replica))
        # Ulysses and ring subgroups nest inside the sp group.
        assert set(info.ulysses_group) <= set(info.sp_group)
        assert set(info.ring_group) <= set(info.sp_group)


def test_replicas_are_contiguous(config: ParallelConfig) -> None:
    g = config.gang_size
    all_ranks: list[int] = []
    for r in range(config.dp):
        ranks = replica_ranks(config, r)
        assert ranks == range(r * g, (r + 1) * g)
        assert all(rank_info(config, x).replica == r for x in ranks)
        all_ranks.extend(ranks)
    assert all_ranks == list(range(config.world_size))


def test_one_driver_per_replica_at_its_first_rank(config: ParallelConfig) -> None:
    drivers = [i for i in infos(config) if i.is_driver]
    outputs = [i for i in infos(config) if i.is_output_rank]
    assert [d.replica for d in drivers] == list(range(config.dp))
    assert [d.global_rank for d in drivers] == [r * config.gang_size for r in range(config.dp)]
    assert drivers == outputs
    assert all(d.local_rank == 0 for d in drivers)


def test_endpoints(config: ParallelConfig) -> None:
    eps = replica_endpoints("10.0.0.5", 5000, config.dp)
    assert eps == [f"tcp://10.0.0.5:{5000 + r}" for r in range(config.dp)]
    assert eps == [replica_endpoint("10.0.0.5", 5000, r) for r in range(config.dp)]


def test_describe() -> None:
    c = ParallelConfig(sp=2, cfg=2, dp=3)
    assert describe(c) == "tp1-sp2(u2r1)-cfg2-dp3"
    assert describe(ParallelConfig(tp=2, sp=4, ulysses=2, ring=2)) == "tp2-sp4(u2r2)-cfg1-dp1"


def test_the_axes_are_those_the_worker_implements() -> None:
    # tp, sp (Ulysses x ring) and cfg have flags and code (dpserve.worker.parallel); a
    # replica is a gang. No pipeline-parallel axis: nothing would run its stages.
    assert set(AXES) == {"tp", "sp", "ulysses", "ring", "cfg", "replica"}
    with pytest.raises(TypeError):
        ParallelConfig(pp=2)  # type: ignore[call-arg]


def test_an_older_replicas_pp_axis_is_ignored_by_the_contract() -> None:
    import msgspec

    from dpserve.contract.model_info import GangShape

    reported = {"tp": 1, "sp": 2, "ulysses": 2, "ring": 1, "pp": 1, "cfg": 2}  # an older replica
    gang = msgspec.structs.asdict(msgspec.convert(reported, GangShape))
    assert describe(ParallelConfig(**gang, dp=3)) == "tp1-sp2(u2r1)-cfg2-dp3"


def test_sp_defaults_to_pure_ulysses() -> None:
    c = ParallelConfig(sp=4)
    assert (c.ulysses, c.ring) == (4, 1)
    assert ParallelConfig(sp=4, ring=4).ulysses == 1


def test_from_world_size() -> None:
    c = ParallelConfig.from_world_size(12, tp=2, sp=2)
    assert c == ParallelConfig(tp=2, sp=2, ulysses=2, dp=3)
    with pytest.raises(
        LayoutError,
        match=r"world size 6 is not divisible by the gang size 4 \(tp\*sp\*cfg\)",
    ):
        ParallelConfig.from_world_size(6, sp=2, cfg=2)


def test_ipv6_endpoint_is_bracketed() -> None:
    assert replica_endpoint("::1", 5000, 2) == "tcp://[::1]:5002"
    assert replica_endpoint("[::1]", 5000, 0) == "tcp://[::1]:5000"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 0}, r"tp must be >= 1 \(got 0\)"),
        ({"sp": -1}, r"sp must be >= 1 \(got -1\)"),
        ({"ulysses": 0}, r"ulysses must be >= 1 \(got 0\)"),
        ({"ring": 0}, r"ring must be >= 1 \(got 0\)"),
        ({"cfg": 0}, r"cfg must be >= 1 \(got 0\)"),
        ({"dp": 0}, r"dp must be >= 1 \(got 0\)"),
        ({"tp": True}, r"tp must be an int \(got True\)"),
        ({"tp": 2.0}, r"tp must be an int"),
        ({"cfg": 3}, r"cfg must be 1 or 2 \(got 3\).*classifier-free guidance"),
        ({"sp": 2, "ulysses": 2, "ring": 2}, r"ulysses \* ring must equal sp \(2 \* 2 != 2\)"),
        ({"ulysses": 2}, r"ulysses \* ring must equal sp \(2 \* 1 != 1\)"),
    ],
)
def test_invalid_config(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        ParallelConfig(**kwargs)


def test_layout_error_is_value_error() -> None:
    assert issubclass(LayoutError, ValueError)


def test_validate_heads() -> None:
    ParallelConfig(tp=2, sp=2).validate(num_heads=8)
    # Ring attention keeps every head, so only ulysses * tp must divide the heads.
    ParallelConfig(sp=4, ring=4).validate(num_heads=6)
    with pytest.raises(
        LayoutError, match=r"attention heads \(6\) must be divisible by ulysses \* tp \(4\)"
    ):
        ParallelConfig(tp=2, sp=2).validate(num_heads=6)
    with pytest.raises(LayoutError, match=r"attention heads must be >= 1 \(got 0\)"):
        ParallelConfig().validate(num_heads=0)


def test_validate_world_size() -> None:
    c = ParallelConfig(sp=2, cfg=2, dp=2)
    c.validate(world_size=8)
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by the gang size 4"):
        c.validate(world_size=6)
    with pytest.raises(LayoutError, match=r"world size 12 does not match dp \* gang size"):
        c.validate(world_size=12)


def test_out_of_range_lookups() -> None:
    c = ParallelConfig(tp=2, dp=2)
    with pytest.raises(LayoutError, match=r"global rank 4 is out of range for world size 4"):
        rank_info(c, 4)
    with pytest.raises(LayoutError, match=r"global rank -1 is out of range"):
        rank_info(c, -1)
    with pytest.raises(LayoutError, match=r"replica 2 is out of range for dp 2"):
        replica_ranks(c, 2)
    with pytest.raises(LayoutError, match=r"tp_rank 2 is out of range 0\.\.1"):
        rank_of(c, tp_rank=2)
    with pytest.raises(LayoutError, match=r"unknown axis 'dp'"):
        all_groups(c, "dp")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "port", "replica", "match"),
    [
        ("h", 0, 0, r"scheduler port 0 must be in 1\.\.65535"),
        ("h", 70000, 0, r"scheduler port 70000 must be in 1\.\.65535"),
        ("h", 65535, 1, r"port 65536 for replica 1 .* outside the valid port range 1\.\.65535"),
        ("h", 5000, -1, r"replica must be >= 0 \(got -1\)"),
        ("", 5000, 0, r"host must be a non-empty string"),
    ],
)
def test_invalid_endpoint(host: str, port: int, replica: int, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        replica_endpoint(host, port, replica)


def test_invalid_endpoints() -> None:
    assert replica_endpoints("h", 65534, 2) == ["tcp://h:65534", "tcp://h:65535"]
    with pytest.raises(LayoutError, match=r"port 65536 for replica 2"):
        replica_endpoints("h", 65534, 3)
    with pytest.raises(LayoutError, match=r"dp must be >= 1 \(got 0\)"):
        replica_endpoints("h", 5000, 0)
