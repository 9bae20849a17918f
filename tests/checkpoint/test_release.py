"""The published release's layout (spec 3.2.1): its architecture, config fields and the names and
shapes of its four preview tensors, read and written."""
import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover_lab
from clover_lab import CheckpointError, CloverConfig, CloverModel, ConfigError
from clover_lab.checkpoint.loading import default_model_dir
from clover_lab.checkpoint.names import RELEASE_NAMES

PROMPT = "def main():\n    "


def release_copy(src, dst, transform=None):
    """``src`` (a clover_lab checkpoint with the spec's earlier names) rewritten as the release
    stores it: the four preview tensors renamed, the right taps [conv_dim, K-1], and config.json's
    architectures, model_type and num_shared_experts as the release's converter reads them."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        layer, _, suffix = name.partition(".linear_attn.")
        for release, param in RELEASE_NAMES.items():
            if suffix and "linear_attn." + suffix == param:
                name = f"{layer}.{release}"
                t = t[:, 0].contiguous() if t.dim() == 3 else t
        out[name] = t
    if transform is not None:
        out = transform(out)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.update(architectures=["CloverMoeModelLM"], model_type="clover_moe", num_shared_experts=1)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def embedded():
    return clover_lab.load()


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    return release_copy(default_model_dir(), tmp_path_factory.mktemp("release") / "clover")


def test_release_layout_loads_as_the_embedded_model(embedded, release_dir, gen_one_thread):
    stored = load_file(str(release_dir / "model.safetensors"))
    assert "model.layers.0.linear_attn.conv_right_weight" in stored
    assert stored["model.layers.0.linear_attn.conv_right_weight"].dim() == 2
    assert not any("conv1d_right" in n or n.endswith(".block_scale") for n in stored)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the preview weights are there: no "untrained" warning
        engine = clover_lab.load(release_dir)
    ids = torch.arange(2, 60)[None]
    assert torch.equal(engine.model.logits(ids), embedded.model.logits(ids))
    assert torch.equal(engine.model.denoise_logits(ids[:, :40], ids[:, 40:56]),
                       embedded.model.denoise_logits(ids[:, :40], ids[:, 40:56]))
    a = engine.generate(PROMPT, max_new_tokens=32)
    b = embedded.generate(PROMPT, max_new_tokens=32)
    assert a.token_ids == b.token_ids and a.text == b.text


def test_save_writes_the_release_layout(embedded, release_dir, tmp_path):
    model = CloverModel.from_pretrained(release_dir)
    model.save_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["CloverMoeModelLM"] and config["model_type"] == "clover_moe"
    assert config["num_shared_experts"] == 1
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    original = load_file(str(release_dir / "model.safetensors"))
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[n], original[n]) for n in saved)  # same names, shapes and values


def test_scalar_softmax_parameters_broadcast(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path / "a")
    path = tmp_path / "a"
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.linear_attn.bd_softmax_logit_scale"] = torch.tensor(1.5)
    tensors["model.layers.0.linear_attn.bd_softmax_history_c"] = torch.tensor([0.25])
    save_file(tensors, str(path / "model.safetensors"))
    gdn = CloverModel.from_pretrained(path).model.layers[0].linear_attn
    assert torch.equal(gdn.block_scale, torch.full((4,), 1.5))
    assert torch.equal(gdn.history_log_n, torch.full((4,), 0.25))


def test_old_names_and_three_dim_right_taps_stay_readable(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path / "a")
    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    old = {}
    for name, t in tensors.items():
        for release, param in RELEASE_NAMES.items():
            if name.endswith(release):
                name = name.removesuffix(release) + param
                t = t[:, None] if t.dim() == 2 else t
        old[name] = t.contiguous()
    save_file(old, str(tmp_path / "a" / "model.safetensors"))
    loaded = CloverModel.from_pretrained(tmp_path / "a")
    ids = torch.arange(24)[None]
    assert torch.equal(loaded.denoise_logits(ids[:, :8], ids[:, 8:]), tiny_model.denoise_logits(ids[:, :8], ids[:, 8:]))


@pytest.mark.parametrize("name,shape", [("conv_right_weight", (4,)), ("conv_right_weight", (1, 3)),
                                        ("bd_softmax_history_bias", (2,)), ("bd_softmax_logit_scale", (4, 1))])
def test_release_tensor_of_no_accepted_shape(tiny_model, tmp_path, name, shape):
    tiny_model.save_pretrained(tmp_path / "a")
    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    tensors[f"model.layers.1.linear_attn.{name}"] = torch.zeros(shape)
    save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
    C = tiny_model.config.conv_dim
    accepted = f"expected \\[{C}, 3\\] or \\[{C}, 1, 3\\]" if name == "conv_right_weight" else \
        r"expected \[4\] or \[\] or \[1\]"
    with pytest.raises(CheckpointError, match=rf"'model.layers.1.linear_attn.{name}' has shape "
                                              rf"\[{', '.join(map(str, shape))}\], {accepted}"):
        CloverModel.from_pretrained(tmp_path / "a")


def test_old_and_release_name_for_one_parameter_is_an_error(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path / "a")
    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    tensors["model.layers.0.linear_attn.history_bias"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="are both the parameter 'model.layers.0.linear_attn.history_bias'"):
        CloverModel.from_pretrained(tmp_path / "a")


# --------------------------------------------------------------------------- num_shared_experts
def test_no_shared_expert(tmp_path):
    with_shared = CloverModel.random("clover-tiny", seed=5)
    without = CloverModel.random(CloverConfig.preset("clover-tiny", num_shared_experts=0), seed=5)
    assert not any("shared_expert" in n for n, _ in without.named_parameters())
    params = dict(without.named_parameters())
    with torch.no_grad():
        for name, p in with_shared.named_parameters():
            if name in params:
                p.copy_(params[name])
            elif name.endswith("shared_expert.down_proj.weight"):
                p.zero_()  # the shared expert adds nothing
    ids = torch.arange(40)[None]
    assert torch.equal(without.logits(ids), with_shared.logits(ids))
    without.save_pretrained(tmp_path / "none")
    assert json.loads((tmp_path / "none" / "config.json").read_text())["num_shared_experts"] == 0
    loaded = CloverModel.from_pretrained(tmp_path / "none")
    assert loaded.config.num_shared_experts == 0 and torch.equal(loaded.logits(ids), without.logits(ids))
    config = json.loads((tmp_path / "none" / "config.json").read_text())
    config["num_shared_experts"] = 1  # the config says one, the checkpoint has none
    (tmp_path / "none" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensors missing .*shared_expert"):
        CloverModel.from_pretrained(tmp_path / "none")


@pytest.mark.parametrize("value", [2, -1, True, 1.0, "1"])
def test_num_shared_experts_other_than_zero_or_one(value):
    with pytest.raises(ConfigError, match="num_shared_experts.*must be 1 .* or 0"):
        CloverConfig.preset("clover-tiny", num_shared_experts=value)


# --------------------------------------------------------------------------- custom code, never run
CODE = ("import pathlib\n"
        "pathlib.Path(__file__).with_name('EXECUTED').write_text(__name__)\n"
        "raise RuntimeError('the release\\'s own code was run')\n")


def custom_code_copy(src, dst, tokenizer_code: bool):
    """``src`` in the release's layout with the auto_map a custom-code Hugging Face release carries:
    config.json names configuration / modeling modules (and, ``tokenizer_code``, tokenizer_config.json
    a tokenizer class only its own module defines). Each module records that it ran and raises."""
    release_copy(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_clover.CloverMoeConfig",
                          "AutoModel": "modeling_clover.CloverMoeModel",
                          "AutoModelForCausalLM": "modeling_clover.CloverMoeModelLM"}
    (dst / "config.json").write_text(json.dumps(config))
    for module in ("configuration_clover", "modeling_clover", "tokenization_clover"):
        (dst / f"{module}.py").write_text(CODE)
    if tokenizer_code:
        tok = json.loads((dst / "tokenizer_config.json").read_text())
        tok.update(tokenizer_class="CloverTokenizerFast",
                   auto_map={"AutoTokenizer": [None, "tokenization_clover.CloverTokenizerFast"]})
        (dst / "tokenizer_config.json").write_text(json.dumps(tok))
    return dst


@pytest.fixture(params=[False, True], ids=["config-code", "tokenizer-code"])
def custom_code_dir(request, tmp_path_factory, gen_text_model_dir):
    return custom_code_copy(gen_text_model_dir, tmp_path_factory.mktemp("custom") / "release", request.param)


@pytest.fixture
def no_prompt(monkeypatch):
    """Every question transformers would ask (input()) recorded and answered "no"."""
    asked = []
    monkeypatch.setattr("builtins.input", lambda *a: asked.append(a) or "n")
    return asked


def test_a_custom_code_release_loads_and_generates_without_a_prompt_or_its_code(custom_code_dir, no_prompt,
                                                                               gen_one_thread):
    """transformers asked "Do you wish to run the custom code? [y/N]" on every load of a release with
    an auto_map (15 s in a terminal, a wait on input in Jupyter); clover_lab needs none of its code."""
    from clover_lab.checkpoint.loading import RemoteCodeNotRun

    with pytest.warns(RemoteCodeNotRun, match="modeling_clover.CloverMoeModelLM.*never runs it"):
        engine = clover_lab.load(custom_code_dir)
    assert engine.tokenizer is not None and engine.tokenizer("w5 w6")["input_ids"] == [5, 6]
    assert engine.generate("w5 w6 w7", max_new_tokens=8).text is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per directory
        clover_lab.load(custom_code_dir)
    assert no_prompt == [] and not (custom_code_dir / "EXECUTED").exists()


def test_a_custom_code_release_checks_and_serves_from_the_command_line(custom_code_dir, no_prompt, capsys,
                                                                        monkeypatch, tmp_path, gen_one_thread):
    from fastapi.testclient import TestClient

    from clover_lab.cli.main import main
    from clover_lab.serve.app import create_app

    assert main(["generate", "--model", str(custom_code_dir), "--prompt", "w5 w6", "--max-new-tokens", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == [5, 6]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 500}" for i in range(400)))
    assert main(["check", "--model", str(custom_code_dir), "--data", str(text), "--windows", "1",
                 "--json", str(tmp_path / "report.json")]) == 0
    assert json.loads((tmp_path / "report.json").read_text())["verdict"]
    served = []
    monkeypatch.setattr("clover_lab.serve.server.serve", lambda engine, *a, **k: served.append(engine))
    assert main(["serve", "--model", str(custom_code_dir), "--port", "8123"]) == 0
    with TestClient(create_app(served[0], model_name="release")) as client:
        r = client.post("/v1/completions", json={"model": "release", "prompt": "w5 w6", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert no_prompt == [] and not (custom_code_dir / "EXECUTED").exists()


# --------------------------------------------------------------------------- preview tensors: all, none, or named
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KINDS = [n.removeprefix("linear_attn.") for n in RELEASE_NAMES]
GDN = [0, 1, 2]  # clover-tiny: three GDN layers, then attention (layer 3)


@pytest.fixture(scope="module")
def tiny_saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "a"
    CloverModel.random("clover-tiny", seed=3).save_pretrained(path)
    return path, load_file(str(path / "model.safetensors"))


def _rewritten(src, dst, tensors):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dropped=st.sets(st.tuples(st.sampled_from(GDN), st.sampled_from(KINDS))))
def test_a_checkpoint_missing_some_preview_tensors_names_each(tiny_saved, tmp_path_factory, dropped):
    """A release missing one layer's conv_right_weight, or bd_softmax_history_c everywhere, loaded with the
    warning meant for a checkpoint without any ("the preview mode is untrained"), naming no tensor. Now:
    none missing loads quietly, all missing is that warning, some missing an error naming each."""
    src, tensors = tiny_saved
    kept = {n: t for n, t in tensors.items()
            if not any(n == f"model.layers.{i}.linear_attn.{k}" for i, k in dropped)}
    path = _rewritten(src, tmp_path_factory.mktemp("dropped"), kept)
    if not dropped:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            CloverModel.from_pretrained(path)
    elif len(dropped) == len(GDN) * len(KINDS):
        with pytest.warns(UserWarning, match="no Clover preview weights.*untrained"):
            CloverModel.from_pretrained(path)
    else:
        with pytest.raises(CheckpointError, match="only some of its preview tensors") as e:
            CloverModel.from_pretrained(path)
        for kind in {k for _, k in dropped}:
            layers = sorted(i for i, k in dropped if k == kind)
            said = f"{kind} in every GDN layer (3)" if len(layers) == 3 else \
                f"{kind} in layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}"
            assert said in str(e.value), (said, str(e.value))
        for kind in set(KINDS) - {k for _, k in dropped}:
            assert f"missing {kind}" not in str(e.value) and f"; {kind}" not in str(e.value)


@pytest.mark.parametrize("name", ["model.layers.0.linear_attn.bd_softmax_history_d",  # an unknown preview name
                                  "model.layers.3.linear_attn.conv_right_weight",  # an attention layer's
                                  "model.layers.9.linear_attn.bd_softmax_history_c"])  # past the last layer
def test_a_preview_tensor_the_model_has_no_place_for_is_named(tiny_saved, tmp_path, name):
    src, tensors = tiny_saved
    path = _rewritten(src, tmp_path / "a", {**tensors, name: torch.zeros(4)})
    with pytest.raises(CheckpointError, match=rf"preview tensor\(s\) this model has no place for, e.g. \['{name}'\].*"
                                              r"GDN layers are \[0, 1, 2\]"):
        CloverModel.from_pretrained(path)


@pytest.mark.parametrize("model_type,architectures,ok", [
    ("clover_moe", ["LlamaForCausalLM"], False), ("clover_moe", ["CloverMoeModelLM", "LlamaForCausalLM"], False),
    ("clover_moe", "CloverMoeModelLM", False), ("qwen3_5_moe_text", ["CloverMoeModelLM"], False),
    ("clover_moe", ["CloverMoeModelLM"], True), ("clover_moe", None, True),
    ("qwen3_5_moe_text", ["Qwen3_5MoeForCausalLM"], True)])
def test_config_architectures_must_be_of_the_model_type(tiny_saved, tmp_path, model_type, architectures, ok):
    """A LlamaForCausalLM beside model_type clover_moe loaded: config.json's architectures were never read."""
    src, _ = tiny_saved
    shutil.copytree(src, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    config.update(model_type=model_type, architectures=architectures)
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    if ok:
        CloverModel.from_pretrained(tmp_path / "a")
    else:
        with pytest.raises(CheckpointError, match=r"config.json: config field 'architectures'"):
            CloverModel.from_pretrained(tmp_path / "a")
