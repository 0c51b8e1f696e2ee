"""Catch-up planning: the cheapest set of objects (by bytes) that takes a replica to a version.

Torch-free. The graph: one node per version plus a start node for the replica's current state
(``None`` = it holds nothing). Edges:

* every delta ``base -> version`` (cost: its size), usable when the replica is at ``base``;
  a *chained* delta (``context_version`` set) only when the replica got to ``base`` by applying
  a delta from ``context_version`` (so nodes are (version, how the replica got there));
* every anchor ``* -> version`` (cost: its size), usable from any state, including nothing.

Dijkstra from the start node gives the cheapest plan; ties go to fewer steps (then the first
path found, deterministically). So a plan is one of: a delta chain, a squashed delta (or a chain mixing
them), or an anchor followed by a chain — whichever downloads the fewest bytes. A replica applies
the steps in order; each delta names its base and the codec refuses a wrong base, so a stale plan
fails safely (fetch a fresh one).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from deltarl.weightsync.manifest import ObjectRef, VersionManifest, index_manifests


class UnreachableVersionError(ValueError):
    """No combination of the published anchors and deltas reaches the target version."""


class CatchUpPlan(BaseModel):
    """The objects to fetch and apply, in order, to go from ``current`` to ``target``.

    Example: ``CatchUpPlan(current=7, target=10, steps=(<delta 7->9>, <delta 9->10>),
    total_bytes=3_700_000, anchor_chain_bytes=268_000_000)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    current: int | None = Field(description="Version the replica holds; None: nothing.")
    target: int = Field(description="Version the plan ends at.")
    steps: tuple[ObjectRef, ...] = Field(
        description="Objects to apply in order: optionally one anchor first, then deltas whose "
        "base is the previous step's version. Empty when current == target."
    )
    total_bytes: int = Field(description="Sum of the steps' sizes: bytes to download.")
    anchor_chain_bytes: int | None = Field(
        description="For reporting: bytes of the usual fallback, the newest anchor at or before "
        "target plus the cheapest delta chain from it; None if there is no such path."
    )

    @property
    def keys(self) -> list[str]:
        return [s.key for s in self.steps]

    @property
    def uses_anchor(self) -> bool:
        return any(s.kind == "anchor" for s in self.steps)

    @property
    def versions(self) -> list[int]:
        """Versions the replica passes through, ending with ``target``."""
        return [s.version for s in self.steps]


Node = tuple[int, int | None]
"""A replica's state in the plan graph: (version, base version of the delta it applied last to
get there, or None after an anchor or when unknown). The second part decides which chained
deltas it can use."""

_START: Node = (-1, None)  # the replica holds nothing


@dataclass(slots=True)
class _Graph:
    anchors: dict[int, ObjectRef]  # cheapest accepted anchor per version
    deltas: dict[int, list[ObjectRef]]  # base version -> deltas starting there


def _graph(manifests: Mapping[int, VersionManifest], formats: Collection[str] | None) -> _Graph:
    g = _Graph({}, {})
    for m in manifests.values():
        for o in m.objects:
            if formats is not None and o.format not in formats:
                continue
            if o.kind == "anchor":
                best = g.anchors.get(o.version)
                if best is None or o.size < best.size:
                    g.anchors[o.version] = o
            else:
                assert o.base_version is not None
                g.deltas.setdefault(o.base_version, []).append(o)
    return g


Tree = dict[Node, tuple[int, int, Node, ObjectRef | None]]


def _dijkstra(g: _Graph, start: Node, *, use_anchors: bool, stop: int | None = None) -> Tree:
    """Shortest paths from ``start``: node -> (bytes, steps, predecessor, object). With
    ``stop``, ends at the first node of that version (the cheapest way to reach it)."""
    best: Tree = {start: (0, 0, start, None)}
    heap: list[tuple[int, int, int, int, Node]] = [(0, 0, -start[0], -1, start)]
    done: dict[Node, None] = {}

    def relax(node: Node, cost: int, steps: int, prev: Node, ref: ObjectRef) -> None:
        old = best.get(node)
        if old is None or (cost, steps) < (old[0], old[1]):
            best[node] = (cost, steps, prev, ref)
            tie = -1 if node[1] is None else node[1]
            heapq.heappush(heap, (cost, steps, -node[0], tie, node))

    while heap:
        cost, steps, _, _, node = heapq.heappop(heap)
        if node in done:
            continue
        done[node] = None
        if node[0] == stop:
            break
        if use_anchors and node == start:
            for v, ref in g.anchors.items():
                if v != start[0]:
                    relax((v, None), cost + ref.size, steps + 1, node, ref)
        if node != _START:
            version, via = node
            for ref in g.deltas.get(version, ()):
                if ref.context_version is not None and ref.context_version != via:
                    continue  # chained on a delta this replica did not apply last
                relax((ref.version, version), cost + ref.size, steps + 1, node, ref)
    return {n: best[n] for n in done}


def _path(tree: Tree, node: Node) -> list[ObjectRef]:
    steps: list[ObjectRef] = []
    while True:
        _, _, prev, ref = tree[node]
        if ref is None:
            break
        steps.append(ref)
        node = prev
    steps.reverse()
    return steps


def _reached(tree: Tree, version: int) -> Node | None:
    """The cheapest node of ``version`` in ``tree`` (None: not reached)."""
    nodes = [n for n in tree if n[0] == version]
    return min(nodes, key=lambda n: (tree[n][0], tree[n][1])) if nodes else None


def _as_index(
    manifests: Mapping[int, VersionManifest] | Iterable[VersionManifest],
) -> Mapping[int, VersionManifest]:
    if isinstance(manifests, Mapping):
        return manifests
    return index_manifests(manifests)


def plan_catch_up(
    manifests: Mapping[int, VersionManifest] | Iterable[VersionManifest],
    current: int | None,
    target: int,
    *,
    formats: Collection[str] | None = None,
    context: int | None = None,
) -> CatchUpPlan:
    """The cheapest plan (by bytes) from ``current`` (None: nothing) to ``target``.

    ``manifests``: the published manifests (``BucketReader.manifests()``), by version or as an
    iterable. ``formats``: only objects in these formats are used (None: all). ``context``: the
    base version of the delta the replica applied last to reach ``current`` (None: it has no
    delta context, e.g. after an anchor): a chained delta is planned only where the replica
    will hold its context, i.e. as the first step when ``context`` is its ``context_version``,
    and after a delta from its ``context_version``. ``current`` need not have a manifest any
    more (it may have been garbage-collected): deltas based on it are still used. Raises
    ``ValueError`` if ``target`` has no manifest and :class:`UnreachableVersionError` if no
    path reaches it.
    """
    index = _as_index(manifests)
    if current is not None and (not isinstance(current, int) or current < 0):
        raise ValueError(f"current must be None or a non-negative int, got {current!r}")
    if context is not None and (current is None or not 0 <= context < current):
        raise ValueError(f"context must be None or a version older than current, got {context!r}")
    if target not in index:
        avail = sorted(index)
        span = f"{avail[0]}..{avail[-1]} ({len(avail)} versions)" if avail else "none"
        raise ValueError(f"version {target} is not published; available: {span}")
    g = _graph(index, formats)
    anchor_chain = _anchor_chain_bytes(g, target)
    if current == target:
        return CatchUpPlan(
            current=current, target=target, steps=(), total_bytes=0, anchor_chain_bytes=anchor_chain
        )
    start: Node = _START if current is None else (current, context)
    tree = _dijkstra(g, start, use_anchors=True, stop=target)
    end = _reached(tree, target)
    if end is None:
        which = "nothing" if current is None else f"version {current}"
        fmt = f" in formats {sorted(formats)}" if formats is not None else ""
        anchored = sorted(v for v in g.anchors if v <= target)
        raise UnreachableVersionError(
            f"cannot reach version {target} from {which}{fmt}: no anchor at or before it leads "
            f"there (anchors at {anchored[-5:] or 'none'}) and no delta chain from {which}"
        )
    steps = _path(tree, end)
    return CatchUpPlan(
        current=current,
        target=target,
        steps=tuple(steps),
        total_bytes=tree[end][0],
        anchor_chain_bytes=anchor_chain,
    )


def _anchor_chain_bytes(g: _Graph, target: int) -> int | None:
    """Bytes of the newest anchor at or before ``target`` plus the cheapest delta chain to it."""
    anchored = [v for v in g.anchors if v <= target]
    if not anchored:
        return None
    a = max(anchored)
    tree = _dijkstra(g, (a, None), use_anchors=False, stop=target)
    end = _reached(tree, target)
    if end is None:
        return None
    return g.anchors[a].size + tree[end][0]


def reachable_versions(
    manifests: Mapping[int, VersionManifest] | Iterable[VersionManifest],
    current: int | None = None,
    *,
    formats: Collection[str] | None = None,
) -> set[int]:
    """Every published version some plan from ``current`` (None: nothing) can reach."""
    index = _as_index(manifests)
    g = _graph(index, formats)
    start: Node = _START if current is None else (current, None)
    tree = _dijkstra(g, start, use_anchors=True)
    return {v for v, _ in tree if v in index and v != start[0]} | (
        {current} if current is not None and current in index else set()
    )
