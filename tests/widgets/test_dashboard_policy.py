"""The dashboard's decoding picker (issue #30): a registered policy with its settings, checked
before a run starts, reaching the engine; AR and speculative modes; the views say what ran."""
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.engine.policies import POLICIES, TopKPolicy  # noqa: E402
from clover_lab.engine.sampling import SettingsError  # noqa: E402
from clover_lab.widgets import Dashboard  # noqa: E402


def test_the_picked_policy_reaches_the_engine_and_labels_the_run(view_engine):
    dash = Dashboard(view_engine, max_new_tokens=16, views=("denoise", "speed"), fps=1000)
    seen = []
    handle = view_engine.add_hook("denoise.step", lambda ev: seen.append(len(ev.unmask)))
    try:
        dash.chat.value = False
        assert list(dash.policy.options) == list(POLICIES)  # every registered policy, none hard-coded
        dash.policy.value = "topk"
        dash.policy_settings.value = "k=2"
        assert dash.settings()["policy"] == "topk:k=2"
        res = dash.generate("w1 w2 w3", wait=True, threshold=1.0)  # threshold 1: the rule, not the slider
        assert res.stats.mode == "diffusion" and res.stats.new_tokens == 16
        # top-k with k=2 unmasks two positions per step (the step limit aside): a threshold of 1.0 would not
        assert seen and max(seen) == 2 and sum(seen) >= 16
        label = dash["speed"].summary()[-1]["run"]
        assert "diffusion · topk:k=2" in label and label.startswith(f"run {dash['speed'].run} ")
        assert "topk:k=2" in dash.status.value
        same = view_engine.generate("w1 w2 w3", max_new_tokens=16, policy=TopKPolicy(k=2), threshold=1.0)
        assert same.token_ids == res.token_ids
    finally:
        handle.remove()
        dash.close()


def test_bad_policy_settings_are_refused_before_a_run(view_engine):
    dash = Dashboard(view_engine, max_new_tokens=8, views=("speed",), fps=1000)
    try:
        dash.chat.value = False
        runs = len(dash["speed"].summary())
        dash.policy.value = "topk"
        for bad, match in (("k=0", "k=0"), ("gamma=1", "gamma"), ("k", "name=value")):
            dash.policy_settings.value = bad
            with pytest.raises(SettingsError, match=match):
                dash.generate("w1 w2", wait=True)
            dash._clicked_generate()  # the button: the error in the status line, nothing raised
            assert "color:#b00" in dash.status.value and not dash.running
        assert len(dash["speed"].summary()) == runs and not dash.generate_button.disabled
        dash.policy_settings.value = "k=1/2"  # a schedule, in the CLI's form
        assert dash.generate("w1 w2", wait=True).stats.new_tokens == 8  # still usable
    finally:
        dash.close()


@pytest.mark.parametrize("mode", ["ar", "speculative"])
def test_other_modes_take_no_policy(view_engine, mode):
    dash = Dashboard(view_engine, max_new_tokens=8, views=("speed",), fps=1000)
    try:
        dash.chat.value = False
        dash.policy.value = "topk"
        dash.policy_settings.value = "k=0"  # not read in these modes: not refused either
        dash.mode.value = mode
        assert "policy" not in dash.settings()
        res = dash.generate("w1 w2", wait=True)
        assert res.stats.mode == mode and res.stats.new_tokens == 8
        assert dash["speed"].summary()[-1]["run"].endswith(f"· {mode}")
        ar = view_engine.generate("w1 w2", max_new_tokens=8, mode="ar")
        assert res.token_ids == ar.token_ids  # speculative gives AR's greedy answer
    finally:
        dash.close()
