"""prefix_groups_longest_first: groups stay together, longest groups and requests first."""

import pytest

from bench.prefix_groups import prefix_groups_longest_first


def test_groups_together_longest_group_first_longest_inside():
    prompts = [[1, 1, 5], [2, 2, 6], [1, 1, 7], [3, 3, 8], [2, 2, 9]]
    max_tokens = [10, 50, 30, 20, 5]
    order = prefix_groups_longest_first(prompts, max_tokens, group_tokens=2)
    assert order == [1, 4, 2, 0, 3]


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        prefix_groups_longest_first([[1]], [1, 2])
