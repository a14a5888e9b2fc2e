"""The vision-language families table against the installed transformers: every image-text-to-text model type is
in it, exact (with a route, an image layout and the oracle test that proves it) or refused with its reason."""

from __future__ import annotations

import importlib
import inspect

import pytest
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from lit_packing.models.vlm import NOT_PROVEN, VLM_FAMILIES, vlm_family
from tests.models.test_vlm_exact import FAMILIES

MAPPING = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def test_every_image_text_to_text_family_is_in_the_table():
    """An upgrade that adds or drops a family fails here until the table says what packing does with it."""
    assert sorted(set(MAPPING) - set(VLM_FAMILIES)) == []
    assert sorted(set(VLM_FAMILIES) - set(MAPPING)) == []


def test_each_refused_family_says_why_in_one_line():
    for model_type, family in VLM_FAMILIES.items():
        assert family.model_type == model_type
        if not family.exact:
            assert family.refusal.strip() and "\n" not in family.refusal, model_type
            assert family.route is None and family.layout is None


def test_exactly_the_families_the_oracle_tests_are_marked_exact():
    exact = {t for t, family in VLM_FAMILIES.items() if family.exact}
    assert exact == set(FAMILIES)
    assert all(VLM_FAMILIES[t].layout and "test_vlm_exact.py" in VLM_FAMILIES[t].proof for t in exact)


@pytest.mark.parametrize("model_type", sorted(t for t, f in VLM_FAMILIES.items() if f.route == "mrope-4row"))
def test_a_four_row_family_reads_the_text_row(model_type):
    """`mrope-4row` holds where the installed modeling code splits a 4-row `position_ids` into text and mRoPE."""
    module = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}.modeling_"
                                     f"{model_type_to_module_name(model_type)}")  # fmt: skip
    assert "position_ids.shape[0] == 4" in inspect.getsource(module)


def test_an_unknown_family_is_refused_as_not_proven():
    family = vlm_family("some_future_vlm")
    assert not family.exact and family.refusal.startswith(NOT_PROVEN)
