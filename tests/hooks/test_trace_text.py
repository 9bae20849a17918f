"""A trace stores the text of the token ids it holds (meta.token_text), so that a view replayed
without an engine shows text, not ids; a trace saved before (or without a tokenizer) still loads
and replays with ids."""
import json

import pytest

import clover_lab
from clover_lab.hooks.trace import META_FILE

PROMPT = "w1 w2 w3"


def _record(engine, tmp_path):
    with engine.capture(["denoise.step", "block.commit"]) as cap:
        result = engine.generate(PROMPT, max_new_tokens=16, threshold=0.3)
    path = tmp_path / "trace"
    cap.save(path)
    return result, path


def test_a_trace_carries_the_text_of_its_tokens(view_engine, tmp_path):
    result, path = _record(view_engine, tmp_path)
    trace = clover_lab.load_trace(path)
    tok = trace.tokenizer
    assert tok is not None
    for t in set(result.token_ids):
        assert tok.decode([t]) == view_engine.tokenizer.decode([t], skip_special_tokens=False)
    # only the ids the records hold, not the vocabulary
    assert len(trace.meta["token_text"]) < view_engine.model.config.vocab_size
    assert tok.decode([10**9]) == f"<{10**9}>"  # an id it lacks: shown as one


def test_a_view_replayed_without_an_engine_shows_text(view_engine, tmp_path):
    pytest.importorskip("ipywidgets")
    from clover_lab.widgets import DenoiseView

    result, path = _record(view_engine, tmp_path)
    trace = clover_lab.load_trace(path)
    view = DenoiseView().replay(trace)
    try:
        assert view.engine is None and view.tokens() == result.token_ids
        text = view.text_html(view.state)
        assert view_engine.tokenizer.decode(result.token_ids, skip_special_tokens=True).split()[0] in text
    finally:
        view.close()

    # an old trace (no token_text): it loads, and the view shows ids
    meta_file = path / META_FILE
    doc = json.loads(meta_file.read_text())
    del doc["meta"]["token_text"]
    meta_file.write_text(json.dumps(doc))
    old = clover_lab.load_trace(path)
    assert old.tokenizer is None
    view = DenoiseView().replay(old)
    try:
        assert view.token_source() is None and view._piece(result.token_ids[0]) == str(result.token_ids[0])
    finally:
        view.close()
