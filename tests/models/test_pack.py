"""`pack_model`, the one way a packed model is built: what it finds and sets, the route each non-attention mixer
takes (its packed kernels where they run and the probe finds them exact, else per example), and the refusals."""

from __future__ import annotations

import pytest
import torch

from lit_packing.batch import MODEL_KEYS
from lit_packing.data.collate import PackedCollator
from lit_packing.errors import ConfigError
from lit_packing.models.mixers import describe_routes, keep_mixers_apart, kernel_unavailable
from lit_packing.models.pack import confirm_routes, pack_model
from tests.helpers import TINY_LLAMA, make_examples, per_example_reference, tiny_model
from tests.models.families import tiny_config


def packed_logits(model, examples):
    batch = PackedCollator()(examples)
    return model(**{k: batch[k] for k in MODEL_KEYS if k in batch}, use_cache=False).logits[0]


def test_an_attention_only_model_gets_its_backend_and_no_mixers():
    model = tiny_model(TINY_LLAMA)
    packing = pack_model(model)
    assert (packing.requested, packing.backend, packing.device.type) == ("auto", "per_example", "cpu")
    assert packing.mixers == [] and {"cu_seq_lens_q", "position_ids"} <= packing.keywords
    assert model.config._attn_implementation == "packed_per_example"


def test_a_hybrids_mixers_run_per_example_on_a_cpu_and_the_line_says_why(caplog):
    model = tiny_model(tiny_config("bamba"))
    with caplog.at_level("INFO", logger="lit_packing"):
        packing = pack_model(model)
    [route] = packing.mixers
    assert (route.name, route.kind, route.route) == ("model.layers.0.mamba", "BambaMixer", "per_example")
    assert route.why == "its packed kernels (causal-conv1d, mamba-ssm) run on CUDA, not on cpu"
    line = f"1 token mixer besides attention: 1 BambaMixer per example ({route.why})"
    assert describe_routes(packing.mixers) == line
    assert line in caplog.text
    examples = make_examples([9, 5, 12, 9])
    model.eval()
    ref, _, _ = per_example_reference(model, examples)
    torch.testing.assert_close(packed_logits(model, examples).detach(), ref, atol=1e-4, rtol=1e-4)


def test_a_mixer_without_packed_kernels_says_so():
    model = tiny_model(tiny_config("mamba"), attn="eager")  # Mamba 1: transformers hands its kernels no boundaries
    [route] = keep_mixers_apart(model)[:1]
    assert route.route == "per_example"
    assert kernel_unavailable(model.get_submodule(route.name), "cuda") in (
        "transformers has no packed kernel for it",
        "causal-conv1d, mamba-ssm not installed",
    )


def test_the_kernel_route_asked_for_where_it_cannot_run_is_refused_in_one_line():
    with pytest.raises(ConfigError) as raised:
        pack_model(tiny_model(tiny_config("lfm2")), mixers="kernel")
    assert str(raised.value) == (
        "mixers: model.layers.0.conv (Lfm2ShortConv) cannot take the kernel route on cpu: its packed kernels "
        "(causal-conv1d) run on CUDA, not on cpu; install its kernels' packages, or set mixers=auto (per example "
        "where they are missing)"
    )


@pytest.mark.parametrize("family", ["bamba", "qwen3_next", "lfm2"])
def test_a_kernel_route_the_probe_does_not_find_exact_falls_back_per_example(family):
    """The route a GPU with the kernels installed would take, probed where the kernels are missing (transformers'
    PyTorch path refuses the boundaries): the probe sends the mixers per example, says why, and the model is
    exact."""
    model = tiny_model(tiny_config(family))
    routes = keep_mixers_apart(model)
    for route in routes:
        route.route = "kernel"
    confirm_routes(model, routes, torch.device("cpu"))
    assert routes and all(r.route == "per_example" for r in routes)
    assert all(r.why.startswith("its packed kernels were not exact on cpu: ") for r in routes), routes[0].why
    assert "can't keep packed sequences apart" in routes[0].why, routes[0].why
    pack_model(model, mixers="per_example")
    examples = make_examples([9, 5, 12, 9])
    model.eval()
    ref, _, _ = per_example_reference(model, examples)
    torch.testing.assert_close(packed_logits(model, examples).detach(), ref, atol=1e-4, rtol=1e-4)


def test_a_kernel_route_asked_for_and_not_exact_is_refused_in_one_line():
    model = tiny_model(tiny_config("bamba"))
    routes = keep_mixers_apart(model)
    routes[0].route = "kernel"
    with pytest.raises(ConfigError) as raised:
        confirm_routes(model, routes, torch.device("cpu"), choice="kernel")
    message = str(raised.value)
    assert message.startswith("mixers: the kernel route is not exact on cpu: BambaForCausalLM cannot run a packed row")
    assert "\n" not in message and message.endswith("; set mixers=auto"), message


def test_a_backend_the_model_cannot_run_names_the_backends_that_can():
    with pytest.raises(ConfigError) as raised:
        pack_model(tiny_model(TINY_LLAMA), backend="torch_varlen")
    assert str(raised.value).endswith("on cpu these run: auto, per_example, sdpa_mask"), str(raised.value)
