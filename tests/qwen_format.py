"""A tokenizer of Qwen3.5/3.6's format for tests (the thinking tests and the server's reasoning
tests): byte-level BPE, a chat template that knows enable_thinking, <think> / </think> as added
tokens, trained on ``TEXT``."""
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
TEXT = ("The user asks a question. Let me think about it step by step: first the plan, then the answer. "
        "def main(): return the answer to the question\n") * 20


def qwen_tokenizer(vocab_size: int = 400):
    """A byte-level BPE in Qwen's layout: <|endoftext|> (pad), <|im_start|>, <|im_end|> (EOS) as
    special tokens, <think> and </think> as added non-special ones, as Qwen3.5/3.6 ship them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = QWEN_TEMPLATE
    return fast
