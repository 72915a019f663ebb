"""Changes to the graph that happen whole or not at all, so a bug in qfuse never breaks a compile.

Two scopes (qfuse.errors says what happens to the error itself):

    with new_nodes_removed_on_error(graph): ...   one linear: a pass only inserts nodes until its
                                                  last step redirects the users, so undoing a
                                                  failed rewrite is removing what it inserted
    snapshot = GraphSnapshot(graph); ...; snapshot.restore()
                                                  one pattern family: the graph as it was before
                                                  the family ran, whatever the family did to it
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.fx import Graph


class UndoFailed(RuntimeError):
    """A failed rewrite had already redirected users to its new nodes: only a snapshot can undo it."""


@contextmanager
def new_nodes_removed_on_error(graph: Graph) -> Iterator[None]:
    """If the block raises, erase the nodes it inserted, then re-raise."""
    before = set(graph.nodes)
    try:
        yield
    except Exception as error:
        for node in reversed(list(graph.nodes)):
            if node in before:
                continue
            if node.users:
                raise UndoFailed(f"{type(error).__name__}: {error} (after the rewrite had redirected "
                                 f"{list(node.users)} to its {node.name})") from error
            graph.erase_node(node)
        raise


class GraphSnapshot:
    """A copy of a graph's nodes (with their meta) that can be put back into the same graph."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.copy = Graph()
        self.copy.output(self.copy.graph_copy(graph, {}))
        (self.output_meta,) = [dict(node.meta) for node in graph.find_nodes(op="output")]

    def restore(self) -> None:
        """Replace every node of the graph with the snapshot's (placeholders keep their targets and
        order; node names may gain a suffix, since FX never reuses a name)."""
        for node in reversed(list(self.graph.nodes)):  # users before what they use
            self.graph.erase_node(node)
        output = self.graph.output(self.graph.graph_copy(self.copy, {}))
        output.meta.update(self.output_meta)
