"""Consistent hashing: which node of a cluster owns a cache key.

Each node sits at ``vnodes`` pseudo-random points of a 64-bit ring; a key belongs
to the first point clockwise of its own hash. Adding or removing a node moves only
the keys between its points and their predecessors (about 1/N of all keys), and
many points per node even out the load. Positions come from blake2b, never from
Python's per-process randomised ``hash``, so every process and machine agrees.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable

__all__ = ["ConsistentHashRing"]

_POINT_PERSONALISATION = b"swallow-ring-pt"
_KEY_PERSONALISATION = b"swallow-ring-key"


class ConsistentHashRing:
    """An immutable ring: ``with_node`` / ``without_node`` return a new one."""

    __slots__ = ("_nodes", "_vnodes", "_points", "_point_nodes")

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = 160) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        unique_nodes = tuple(dict.fromkeys(nodes))
        for node in unique_nodes:
            if not isinstance(node, str) or not node:
                raise ValueError(f"node names must be non-empty str, got {node!r}")
        self._nodes = unique_nodes
        self._vnodes = vnodes
        # Ties between two nodes' points (vanishingly rare) break by name, so the
        # owner never depends on the order nodes were listed in.
        ring = sorted((_point(f"{node}#{index}"), node) for node in unique_nodes for index in range(vnodes))
        self._points = [position for position, _ in ring]
        self._point_nodes = [node for _, node in ring]

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._nodes

    @property
    def vnodes(self) -> int:
        return self._vnodes

    def node_for(self, key: bytes | str) -> str:
        """The node owning ``key``; LookupError if the ring is empty."""
        if not self._points:
            raise LookupError("consistent-hash ring has no nodes")
        return self._point_nodes[self._first_point_after(key)]

    def owners(self, key: bytes | str, n: int) -> list[str]:
        """The first ``n`` distinct nodes clockwise from ``key`` (fewer if the ring has
        fewer): the owner first, then the replicas / fallbacks in order."""
        if n < 0:
            raise ValueError(f"n must be non-negative, got {n}")
        if not self._points:
            raise LookupError("consistent-hash ring has no nodes")
        wanted = min(n, len(self._nodes))
        found: list[str] = []
        index = self._first_point_after(key)
        while len(found) < wanted:
            node = self._point_nodes[index]
            if node not in found:
                found.append(node)
            index = (index + 1) % len(self._points)
        return found

    def with_node(self, node: str) -> ConsistentHashRing:
        """This ring plus ``node``; ValueError if it is already a member."""
        if node in self._nodes:
            raise ValueError(f"node {node!r} is already on the ring")
        return ConsistentHashRing((*self._nodes, node), self._vnodes)

    def without_node(self, node: str) -> ConsistentHashRing:
        """This ring minus ``node``; KeyError if it is not a member."""
        if node not in self._nodes:
            raise KeyError(node)
        return ConsistentHashRing((member for member in self._nodes if member != node), self._vnodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConsistentHashRing):
            return NotImplemented
        return set(self._nodes) == set(other._nodes) and self._vnodes == other._vnodes

    def __hash__(self) -> int:
        return hash((frozenset(self._nodes), self._vnodes))

    def __repr__(self) -> str:
        return f"ConsistentHashRing({list(self._nodes)!r}, vnodes={self._vnodes})"

    def _first_point_after(self, key: bytes | str) -> int:
        index = bisect.bisect_right(self._points, _key_position(key))
        return index if index < len(self._points) else 0


def _point(label: str) -> int:
    digest = hashlib.blake2b(label.encode("utf-8"), digest_size=8, person=_POINT_PERSONALISATION)
    return int.from_bytes(digest.digest(), "little")


def _key_position(key: bytes | str) -> int:
    data = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    digest = hashlib.blake2b(data, digest_size=8, person=_KEY_PERSONALISATION)
    return int.from_bytes(digest.digest(), "little")
