"""Tree attention masks against brute-force masks built from the parent pointers; tree shapes."""

from __future__ import annotations

import random

import pytest
import torch

from polydraft.decoding.lm import additive_mask
from polydraft.decoding.tree import Tree, TreeShape, ancestor_mask, target_order, tree_attention


def random_tree(rng: random.Random, levels: int) -> Tree:
    """Random level-ordered tree: each node's parent is a node of the previous level (or the root)."""
    tree = Tree()
    previous = [-1]
    for depth in range(1, levels + 1):
        current = []
        for _ in range(rng.randint(1, 4)):
            tree.tokens.append(rng.randrange(100))
            tree.parents.append(rng.choice(previous))
            tree.depths.append(depth)
            current.append(len(tree.tokens) - 1)
        previous = current
    return tree


def brute_force_ancestors(parents: list[int]) -> torch.Tensor:
    size = len(parents)
    result = torch.zeros(size, size, dtype=torch.bool)
    for node in range(size):
        walk = node
        while walk >= 0:
            result[node, walk] = True
            walk = parents[walk]
    return result


@pytest.mark.parametrize("seed", range(20))
def test_ancestor_mask_matches_brute_force_for_every_node_and_for_a_level(seed):
    tree = random_tree(random.Random(seed), levels=1 + seed % 5)
    size = len(tree)
    expected = brute_force_ancestors(tree.parents)
    assert torch.equal(ancestor_mask(tree.parents, range(size), torch.device("cpu")), expected)
    last = [i for i in range(size) if tree.depths[i] == max(tree.depths)]
    assert torch.equal(ancestor_mask(tree.parents, last, torch.device("cpu")), expected[last])
    # in the target's input order (rows and columns both permuted), as its verification reads the tree
    order = target_order(tree)
    permuted = expected[order][:, order]
    assert torch.equal(ancestor_mask(tree.parents, order, torch.device("cpu"), order), permuted)


def test_ancestor_mask_of_no_rows_or_no_nodes_has_the_shape_it_names():
    assert ancestor_mask([-1, 0], [], torch.device("cpu")).shape == (0, 2)
    assert ancestor_mask([], [], torch.device("cpu")).shape == (0, 0)


@pytest.mark.parametrize(("cached", "pending"), [(0, 1), (0, 5), (4, 1), (7, 3), (5, 0)])
def test_tree_attention_matches_a_brute_force_mask_from_positions_and_parents(cached, pending):
    tree = random_tree(random.Random(cached * 10 + pending), levels=3)
    size = len(tree)
    mask = tree_attention(cached, pending, brute_force_ancestors(tree.parents), torch.float32)
    # brute force: query j (pending chain, then nodes) may see key k when k is in the past of j
    total = cached + pending + size
    expected = torch.zeros(pending + size, total, dtype=torch.bool)
    for row in range(pending + size):
        for key in range(total):
            if row < pending:
                expected[row, key] = key <= cached + row
            elif key < cached + pending:
                expected[row, key] = True
            else:
                node, other = row - pending, key - cached - pending
                walk = node
                while walk >= 0 and walk != other:
                    walk = tree.parents[walk]
                expected[row, key] = walk == other
    assert mask.shape == (1, 1, pending + size, total)
    assert torch.equal(mask[0, 0] == 0, expected)
    assert torch.equal(mask, additive_mask(expected, torch.float32))
    assert (mask[0, 0][~expected] == torch.finfo(torch.float32).min).all()


def test_tree_shapes_and_their_sizes():
    assert TreeShape.constant([2, 2, 1]).max_nodes == 2 + 4 + 4
    assert TreeShape.constant([3, 1]).depth == 2
    assert TreeShape.beam(3, 4).max_nodes == 12
    with pytest.raises(ValueError, match="branching"):
        TreeShape.constant([2, 0])
    with pytest.raises(ValueError, match="beam width"):
        TreeShape.beam(0, 3)


def test_children_keep_draw_order():
    tree = Tree(tokens=[5, 9, 4, 1, 2], parents=[-1, -1, 1, 0, 1], depths=[1, 1, 2, 2, 2])
    assert tree.children() == {-1: [0, 1], 1: [2, 4], 0: [3]}


def test_the_target_reads_the_chain_of_first_children_first_and_every_path_in_increasing_slots():
    tree = Tree(tokens=[5, 9, 4, 1, 2, 7], parents=[-1, -1, 1, 0, 1, 3], depths=[1, 1, 2, 2, 2, 3])
    assert target_order(tree) == [0, 3, 5, 1, 2, 4]  # 0 -> 3 -> 5 first, then the rest level by level
    rng = random.Random(0)
    for _ in range(50):
        tree = random_tree(rng, rng.randint(1, 5))
        order = target_order(tree)
        assert sorted(order) == list(range(len(tree)))
        slot = {node: index for index, node in enumerate(order)}
        for leaf in range(len(tree)):  # the path to every node: the cache keeps it with sorted slots
            path, node = [], leaf
            while node >= 0:
                path.append(slot[node])
                node = tree.parents[node]
            assert path[::-1] == sorted(path)
