"""Checkpoint defaults (clover_lab/checkpoint/defaults.py): a real Qwen3.5-MoE checkpoint, whose config has no
mask token, runs block diffusion without one set by hand; generation_config.json's block size,
mask token and EOS ids reach the engine and the CLI; the loading progress bar is a flag."""
import json
import shutil

import pytest

import clover_lab
from clover_lab import GenerationError
from clover_lab.cli import main as cli

pytestmark = pytest.mark.usefixtures("gen_one_thread")


def word_tokenizer(size: int, mask_token=None, extra=()):
    """A word-level tokenizer of ``size`` ids: w0.., then <unk>, <|endoftext|> and ``extra`` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|endoftext|>", *extra]
    vocab = {f"w{i}": i for i in range(size - len(specials))}
    vocab.update({t: size - len(specials) + j for j, t in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kwargs = {"mask_token": mask_token} if mask_token else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>", **kwargs)


@pytest.fixture
def qwen_dir(reference, tmp_path):
    """transformers' Qwen3.5-MoE checkpoint (no mask_token_id in config.json), 512 embedding rows."""
    d = tmp_path / "qwen"
    shutil.copytree(reference[1], d)
    assert "mask_token_id" not in json.loads((d / "config.json").read_text())
    return d


def load_quietly(path):
    with pytest.warns(UserWarning, match="preview"):  # a plain Qwen checkpoint: the preview is untrained
        return clover_lab.load(path)


def test_a_qwen_checkpoint_takes_the_last_embedding_row_past_its_tokenizer(qwen_dir):
    word_tokenizer(500).save_pretrained(qwen_dir)
    engine = load_quietly(qwen_dir)
    assert engine.mask_token_id == 511 and engine.mask_token_source.startswith("the last embedding row")
    result = engine.generate([1, 2, 3, 4], max_new_tokens=16, threshold=0.9)  # block diffusion, no setting by hand
    assert len(result.token_ids) == 16 and 511 not in result.token_ids


@pytest.mark.parametrize("mask_token,extra,expected", [("<|mask|>", ("<|mask|>",), 511), (None, ("<mask>", "x"), 510)],
                         ids=["mask_token", "added-token"])
def test_the_tokenizers_mask_token_comes_first(qwen_dir, mask_token, extra, expected):
    word_tokenizer(512, mask_token=mask_token, extra=extra).save_pretrained(qwen_dir)
    engine = load_quietly(qwen_dir)
    assert engine.mask_token_id == expected and "tokenizer" in engine.mask_token_source


def test_generation_config_sets_mask_block_size_and_eos(qwen_dir):
    word_tokenizer(512).save_pretrained(qwen_dir)  # covers the embedding: no spare row
    (qwen_dir / "generation_config.json").write_text(json.dumps(
        {"mask_token_id": 7, "block_size": 8, "eos_token_id": [3, 4], "threshold": 0.7}))
    engine = load_quietly(qwen_dir)
    assert (engine.mask_token_id, engine.mask_token_source, engine.block_size) == (7, "generation_config.json", 8)
    assert set(engine.eos_token_ids) >= {3, 4} and engine.settings.threshold == 0.7
    assert engine.generate([20, 21, 22], max_new_tokens=16, threshold=1.0).stats.blocks == 2  # blocks of 8


def test_no_mask_anywhere_refuses_diffusion_saying_where_it_looked(qwen_dir):
    word_tokenizer(512).save_pretrained(qwen_dir)
    engine = load_quietly(qwen_dir)
    assert engine.mask_token_id is None
    with pytest.raises(clover_lab.GenerationError, match="generation_config.json .* tokenizer"):
        engine.generate([1, 2, 3], max_new_tokens=4)
    assert len(engine.generate([1, 2, 3], mode="ar", max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("content,match", [('{"block_size": 0}', "block_size=0"),
                                           ('{"mask_token_id": "m"}', "mask_token_id='m'")])
def test_bad_generation_fields_are_named(gen_model_dir, tmp_path, content, match):
    d = tmp_path / "m"
    shutil.copytree(gen_model_dir, d)
    (d / "generation_config.json").write_text(content)
    with pytest.raises(clover_lab.CheckpointError, match=f"generation_config.json: {match}"):
        clover_lab.load(d)


def test_the_cli_takes_the_generation_config_and_the_progress_flag(capsys, gen_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(gen_model_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"block_size": 4, "max_new_tokens": 8}))
    code = cli.main(["generate", "--model", str(d), "--prompt-ids", "5,6,7", "--json", "--progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    stats = json.loads(out.out)["stats"]
    assert stats["block_size"] == 4 and stats["new_tokens"] <= 8
    assert "loading m" in out.err  # the bar, forced on for a small checkpoint
    assert cli.main(["generate", "--model", str(d), "--prompt-ids", "5,6,7", "--json", "--no-progress"]) == 0
    assert "loading m" not in capsys.readouterr().err


def test_a_bad_default_coreset_is_blamed_on_what_set_it(gen_model_dir, tmp_path):
    import shutil

    with pytest.raises(GenerationError, match=r"load\(coreset_size=1\)") as info:
        clover_lab.load(gen_model_dir, coreset_size=1)
    assert "generation_config.json" not in str(info.value)
    shutil.copytree(gen_model_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"coreset_size": 1}))
    with pytest.raises(clover_lab.CheckpointError, match="generation_config.json: coreset_size=1"):
        clover_lab.load(tmp_path / "m")
