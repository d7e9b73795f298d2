"""The process layout (layout.py): which process rank is which member's shard or sampler, and the endpoints the
exchange numbers."""

from __future__ import annotations

from ftis_engine.topology.layout import (Seat, describe_layout, endpoint_ranks, endpoint_roles, member_ranks, process_roles,
                                sampler_endpoints, world_size)

from .helpers import short_config


def test_a_members_ranks_sit_side_by_side_and_the_exchange_sees_one_endpoint_per_member():
    config = short_config("swarm.mode=async", "members.0.ranks=3", "members.1.ranks=2", "members.1.samplers=1")
    roles = process_roles(config)
    assert roles == [Seat(0, None, 0, 0), Seat(0, None, 1, None), Seat(0, None, 2, None), Seat(1, None, 0, 1),
                     Seat(1, None, 1, None), Seat(1, 0, 0, 2)]
    assert world_size(config) == 6  # what --nproc must be
    assert endpoint_ranks(config) == [0, 3, 5]  # endpoint_roles' endpoints: member 0, member 1, member 1's sampler
    assert endpoint_roles(config) == [(0, None), (1, None), (1, 0)]
    assert member_ranks(config, 0) == [0, 1, 2] and member_ranks(config, 1) == [3, 4]
    layout = describe_layout(config)
    assert "rank 0: tiny-s: shard 1/3 (leader)" in layout and "rank 4: tiny-m-lora: shard 2/2" in layout
    assert "rank 5: tiny-m-lora: sampler 0" in layout


def test_one_rank_members_keep_the_old_layout():
    config = short_config("swarm.mode=async", "members.1.samplers=2")
    roles = process_roles(config)
    assert [(r.member, r.sampler) for r in roles] == endpoint_roles(config)
    assert [r.endpoint for r in roles] == list(range(len(roles))) == endpoint_ranks(config)


def test_sampler_endpoints_follow_the_learners_in_member_order():
    config = short_config("swarm.mode=async", "members.0.samplers=2", "members.1.samplers=1")
    assert sampler_endpoints(config, 0) == [2, 3] and sampler_endpoints(config, 1) == [4]
