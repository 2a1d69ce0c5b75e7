"""Distributed prompt loading of a multi-controller run: the prompt file and each worker's shard."""

import pytest

from sluice.api import PromptItem
from sluice.dag.loader import ShardLoader, write_prompt_file


def _items(n):
    return [PromptItem(k, f"p{k}", (1, 2, k), {"answer": str(k), "data_source": "t"}) for k in range(n)]


def test_shards_of_the_prompt_file_are_disjoint_and_cover_it(tmp_path):
    source = write_prompt_file(_items(10), tmp_path / "prompts.jsonl")
    shards = [source.load(r, 3) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 4]
    assert sorted(i.index for s in shards for i in s) == list(range(10))
    assert shards[1][0] == PromptItem(3, "p3", (1, 2, 3), {"answer": "3", "data_source": "t"})


def test_a_field_json_cannot_hold_is_named(tmp_path):
    items = [PromptItem(7, "p", (1,), {"answer": object()})]
    with pytest.raises(ValueError, match="prompt row 7"):
        write_prompt_file(items, tmp_path / "p.jsonl")


def test_a_seeded_shard_walks_each_epoch_in_its_own_order_and_its_cursor_resumes_it(tmp_path):
    source = write_prompt_file(_items(12), tmp_path / "prompts.jsonl")
    loader = ShardLoader(source, 1, 2, seed=5)
    first, second = loader.take(6), loader.take(6)
    assert sorted(i.index for i in first) == sorted(i.index for i in second) == list(range(6, 12))
    assert [i.index for i in first] != [i.index for i in second]  # reshuffled per epoch
    cursor = loader.cursor()
    ahead = loader.take(4)
    again = ShardLoader(source, 1, 2, seed=5)
    again.restore(cursor)
    assert again.take(4) == ahead
    assert [i.index for i in ShardLoader(source, 0, 2, seed=5).take(6)] != [i.index for i in first]
