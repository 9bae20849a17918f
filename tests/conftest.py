"""Shared fixtures: small reference checkpoints written by transformers' own Qwen3.5-MoE."""
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    # read when triton is first imported: set before any test module can import it (tests/kernels)
    os.environ.setdefault("TRITON_INTERPRET", "1")

REF_SIZES = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=4096,
)


def make_reference(seed: int = 0):
    """A random transformers Qwen3_5MoeForCausalLM (6 GDN + 2 attention layers, 8 experts top-2, GQA,
    key heads != value heads, partial RoPE) with every weight perturbed, norms included, so that
    no parameter sits at a trivial value."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**REF_SIZES)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" not in name:
                p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.fixture(scope="session")
def reference():
    """(transformers model, its save_pretrained directory)."""
    import tempfile

    model = make_reference()
    path = tempfile.mkdtemp(prefix="clover-ref-")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="session")
def clover_ref(reference):
    from clover_lab import CloverModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CloverModel.from_pretrained(reference[1])


@pytest.fixture(scope="session")
def prompt_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, REF_SIZES["vocab_size"], (1, 150), generator=g)


@pytest.fixture
def tiny_model():
    from clover_lab import CloverModel

    model = CloverModel.random("clover-tiny", seed=3)
    # non-default preview weights, so that the preview operator is exercised as trained models use it
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for name, p in model.named_parameters():
            if "conv1d_right" in name or "history" in name or "block_scale" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


# --------------------------------------------------------------------------- generation (issue 3)
# Fixture names start with gen_ / tiny_*engine so they stay apart from the model-core fixtures above.
GEN_EOS = 510
GEN_MASK = 511
GEN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 'w1' if m['role'] == 'user' else 'w2' }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w3 {% if enable_thinking is defined and enable_thinking %}w4{% else %}w5"
    "{% endif %}{% endif %}"
)


def make_gen_model(seed: int = 0):
    """clover-tiny with random weights and a sharpened LM head, so confidences spread over (0, 1)
    instead of sitting near 1/vocab (a plain random head makes every threshold test trivial)."""
    from clover_lab import CloverModel

    model = CloverModel.random("clover-tiny", seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


def make_gen_tokenizer():
    """A word-level tokenizer matching clover-tiny: w0..w508, <unk>=509, <|endoftext|>=510, <|mask|>=511."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(509)}
    vocab.update({"<unk>": 509, "<|endoftext|>": GEN_EOS, "<|mask|>": GEN_MASK})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                   mask_token="<|mask|>")
    fast.chat_template = GEN_CHAT_TEMPLATE
    return fast


def _no_hooks_left(model):
    leftover = model.hooks.attached()
    model.hooks.clear()
    assert not leftover, f"hooks left attached after the test: {leftover}"


@pytest.fixture(scope="session")
def gen_model():
    return make_gen_model()


@pytest.fixture
def new_gen_model():
    """Makes fresh generation models, free to be damaged by the test."""
    return make_gen_model


@pytest.fixture(scope="session")
def gen_tokenizer():
    return make_gen_tokenizer()


@pytest.fixture
def tiny_engine(gen_model):
    """A fresh Engine over the shared generation model (no tokenizer); no hook may outlive the test."""
    from clover_lab import Engine

    yield Engine(gen_model)
    _no_hooks_left(gen_model)


@pytest.fixture
def tiny_text_engine(gen_model, gen_tokenizer):
    from clover_lab import Engine

    yield Engine(gen_model, gen_tokenizer)
    _no_hooks_left(gen_model)


@pytest.fixture
def view_engine(tiny_text_engine, gen_one_thread):
    """The text engine the notebook views watch (tests/test_widgets*.py), on one intra-op thread."""
    return tiny_text_engine


@pytest.fixture(scope="session")
def gen_model_dir(tmp_path_factory):
    """The generation model saved with no tokenizer."""
    d = tmp_path_factory.mktemp("gen_model")
    make_gen_model().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def gen_text_model_dir(tmp_path_factory, gen_tokenizer):
    """The generation model saved with the word-level tokenizer."""
    d = tmp_path_factory.mktemp("gen_text_model")
    make_gen_model().save_pretrained(d)
    gen_tokenizer.save_pretrained(d)
    return d


@pytest.fixture
def gen_one_thread():
    """Tiny models run ~10x faster on one intra-op thread than on two contended ones; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
