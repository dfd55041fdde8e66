"""ConsistentHashRing: minimal movement on membership change, balance, determinism."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from embedding_cache import ConsistentHashRing, media_key

REPO_ROOT = Path(__file__).resolve().parents[2]
NODES = [f"node-{i}" for i in range(10)]
KEYS = [hashlib.sha256(b"key-%d" % i).digest() for i in range(20_000)]


@pytest.fixture(scope="module")
def ring() -> ConsistentHashRing:
    return ConsistentHashRing(NODES)


@pytest.fixture(scope="module")
def assignment(ring: ConsistentHashRing) -> list[str]:
    return [ring.node_for(key) for key in KEYS]


def test_adding_a_node_moves_about_one_in_n_keys_all_to_it(ring: ConsistentHashRing, assignment: list[str]) -> None:
    grown = ring.with_node("node-10")
    after = [grown.node_for(key) for key in KEYS]
    moved = [(old, new) for old, new in zip(assignment, after) if old != new]
    expected = len(KEYS) / 11
    assert abs(len(moved) - expected) <= 0.35 * expected, len(moved)
    assert all(new == "node-10" for _, new in moved)


def test_removing_a_node_moves_only_its_keys(ring: ConsistentHashRing, assignment: list[str]) -> None:
    shrunk = ring.without_node("node-3")
    for key, old in zip(KEYS, assignment):
        new = shrunk.node_for(key)
        assert new == old if old != "node-3" else new != "node-3"


def test_membership_changes_return_new_rings(ring: ConsistentHashRing) -> None:
    grown = ring.with_node("node-10")
    assert ring.nodes == tuple(NODES) and "node-10" in grown and len(grown) == 11
    assert grown.without_node("node-10") == ring
    with pytest.raises(ValueError):
        ring.with_node("node-0")
    with pytest.raises(KeyError):
        ring.without_node("node-99")


@pytest.mark.parametrize(
    "nodes",
    [NODES, [f"10.0.0.{i}:8000" for i in range(1, 11)], [f"cache-{i:02d}.swallow.internal" for i in range(10)]],
)
def test_load_is_balanced_with_160_vnodes(nodes: list[str]) -> None:
    # Measured max/mean for these names: 1.08 / 1.11 / 1.14. Over 60 random naming
    # schemes the worst was 1.30, so 1.3 is a real (deterministic) property here.
    ring = ConsistentHashRing(nodes, vnodes=160)
    loads = Counter(ring.node_for(key) for key in KEYS)
    assert set(loads) == set(nodes)
    assert max(loads.values()) <= 1.3 * len(KEYS) / len(nodes)


def test_owners_are_distinct_and_start_with_the_owner(ring: ConsistentHashRing) -> None:
    for key in KEYS[:500]:
        owners = ring.owners(key, 3)
        assert len(set(owners)) == 3 and owners[0] == ring.node_for(key)
    assert sorted(ring.owners(KEYS[0], 50)) == sorted(NODES)  # capped at the ring's size
    assert ring.owners(KEYS[0], 0) == []


def test_owners_fall_back_to_the_next_owner_when_the_first_leaves(ring: ConsistentHashRing) -> None:
    for key in KEYS[:500]:
        first, second = ring.owners(key, 2)
        assert ring.without_node(first).node_for(key) == second


def test_empty_ring_raises_lookup_error() -> None:
    empty = ConsistentHashRing()
    with pytest.raises(LookupError):
        empty.node_for(b"x")
    with pytest.raises(LookupError):
        empty.owners("x", 1)
    assert ConsistentHashRing(["only"]).without_node("only").nodes == ()


def test_node_order_and_duplicates_do_not_matter() -> None:
    forward = ConsistentHashRing(NODES)
    backward = ConsistentHashRing([*reversed(NODES), NODES[0]])
    assert all(forward.node_for(key) == backward.node_for(key) for key in KEYS[:2000])


_SNIPPET = """
import hashlib
from embedding_cache import ConsistentHashRing
ring = ConsistentHashRing([f"node-{i}" for i in range(10)])
print(",".join(ring.node_for(hashlib.sha256(b"key-%d" % i).digest()) for i in range(200)), ring.node_for("a str key"))
"""


def test_deterministic_across_processes(ring: ConsistentHashRing, assignment: list[str]) -> None:
    expected = ",".join(assignment[:200]) + " " + ring.node_for("a str key")
    for seed in ("3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _SNIPPET], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected


def test_media_keys_route(ring: ConsistentHashRing) -> None:
    key = media_key("image", b"\x89PNG...", {"patch": 14}, "enc")
    assert ring.node_for(key) in NODES
