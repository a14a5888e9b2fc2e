"""Example shapes as objects: each knows its columns, how a source holds them and what makes a row untrainable."""

import pickle

import pytest
from datasets import Dataset, Features

from lit_packing.data.shapes import CHAT, GROUP, PREFERENCE, SHAPES, example_problem, example_shape, shape_named


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_shape_survives_pickling_as_itself_and_holds_its_columns(shape):
    assert pickle.loads(pickle.dumps(shape)) is shape  # loader workers and stored shards see the same object
    assert set(shape.columns) <= set(shape.features)
    assert example_shape(list(shape.columns)) is shape
    Features(shape.features)  # the Arrow types a source casts to are valid


def test_a_held_bad_row_fits_the_features_of_its_shape():
    for shape in SHAPES:
        held = shape.held({}, "bad row")
        assert set(held) <= set(shape.features), shape
        Dataset.from_list([held], features=Features({k: shape.features[k] for k in held}))


def test_only_whole_examples_are_atoms_and_chats_read_the_template():
    assert [s.name for s in SHAPES if s.atom] == ["preference", "group"]
    assert [s.name for s in SHAPES if s.unstreamed] == ["preference", "group", "image_chat"]
    assert {s.name for s in SHAPES if s.chat} == {"preference", "group", "image_chat", "chat"}
    assert example_problem("chat", {"messages": [{"role": "user", "content": "Hi"}]}) == "no assistant turn"
    assert CHAT.problem({"messages": [{"role": "user", "content": "Hi"}]}) == "no assistant turn"
    assert shape_named("group") is GROUP and PREFERENCE != GROUP
    with pytest.raises(ValueError, match="no example shape 'image'"):
        shape_named("image")
