"""The dashboard's defaults: a code prompt, and chat mode only for a model trained on its
tokenizer's chat template (a rendered turn ends with one of the engine's EOS tokens)."""
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.widgets import Dashboard  # noqa: E402
from clover_lab.widgets.dashboard import DEFAULT_PROMPT, chat_format  # noqa: E402


def test_chat_mode_only_for_a_model_that_ends_its_turns_with_eos(view_engine):
    tok = view_engine.tokenizer
    assert tok.chat_template is not None
    turn = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True, add_generation_prompt=False)
    turn = list(turn.get("input_ids", turn) if hasattr(turn, "keys") else turn)
    before = list(view_engine.eos_token_ids)
    try:
        view_engine.eos_token_ids = [t for t in before if t not in turn] or [max(turn) + 1]
        assert not chat_format(view_engine)  # a template the model does not stop in: a code model
        dash = Dashboard(view_engine)
        try:
            assert dash.chat.value is False and dash.prompt.value == DEFAULT_PROMPT
            assert DEFAULT_PROMPT.startswith("def ")
        finally:
            dash.close()
        view_engine.eos_token_ids = before + [turn[-1]]
        assert chat_format(view_engine)
        dash = Dashboard(view_engine)
        try:
            assert dash.chat.value is True
        finally:
            dash.close()
        dash = Dashboard(view_engine, chat=False)
        try:
            assert dash.chat.value is False
        finally:
            dash.close()
    finally:
        view_engine.eos_token_ids = before
