"""Dashboard: every view, a prompt box, the sampler controls, the decoding mode and policy
(block diffusion under a registered policy with its settings, AR, or exact self-speculative),
Generate and Stop.

Generate submits the request (checked at once: a bad setting is an error before anything runs)
and waits for it in a background thread, so the notebook stays responsive and Stop works while it
runs: Stop cancels the request (``Handle.cancel``), which ends it at the next step boundary with
stop reason "cancelled" and the blocks committed so far. The views stay attached to the engine until ``close()``, so generations started
from other cells (``engine.generate(...)``) show up in the dashboard too.
"""
from __future__ import annotations

import html
import threading

from clover_lab.engine.policies import POLICIES
from clover_lab.engine.requests import Request, settings_for_mode
from clover_lab.engine.sampling import CONFIDENCE_RULES
from clover_lab.widgets.base import close_tree
from clover_lab.widgets.denoise import DenoiseView
from clover_lab.widgets.experts import ExpertView
from clover_lab.widgets.memory import MemoryView
from clover_lab.widgets.pieces import export_html, require_notebook
from clover_lab.widgets.speed import SpeedView
from clover_lab.widgets.throttle import Pacer, weak_callback

VIEWS = {"denoise": DenoiseView, "speed": SpeedView, "experts": ExpertView, "memory": MemoryView}
DEFAULT_PROMPT = 'def is_prime(n):\n    """Return True if n is a prime number."""\n'


def chat_format(engine) -> bool:
    """Whether the model was trained on its tokenizer's chat template, so that a prompt is best
    sent as a chat message: the template exists and a turn it renders ends with one of the
    engine's EOS tokens (a chat model stops at the end of its turn: Qwen's instruct checkpoints
    list ``<|im_end|>`` in generation_config.json, base models do not). The embedded model has a
    template (so that ``--chat`` can be tested) but was trained on plain code: no chat."""
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True,
                                            add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that does not render is no format to prompt in
        return False
    ids = ids.get("input_ids", ids) if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return bool(set(int(t) for t in ids) & set(engine.eos_token_ids))


class Dashboard:
    """All views on one engine, with controls. ``generate()`` starts a run from code as the
    Generate button does (``wait=True`` blocks until it ends); ``stop()`` is the Stop button.
    ``chat``: send the prompt as a chat message (default: when the model was trained on its
    tokenizer's template, :func:`chat_format`; a code model gets its prompt as plain text).
    ``pace``: the views redraw one at a time, one every ``pace`` seconds (a :class:`Pacer`), the
    newest state of each when its turn comes; ``fps`` applies to a view only after ``close()``."""

    def __init__(self, engine, *, prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 64, fps: float = 10.0,
                 views=("denoise", "speed", "experts", "memory"), chat: bool | None = None, pace: float = 0.4):
        require_notebook()
        import ipywidgets as W

        unknown = [v for v in views if v not in VIEWS]
        if unknown:
            raise ValueError(f"unknown views {unknown}; known: {', '.join(VIEWS)}")
        self.engine = engine
        self.views = {name: VIEWS[name](engine, fps=fps) for name in views}
        # one view's figures at a time to the browser, the token grid every other turn and with a
        # short gap after it (it is cheap, and what one watches): the page stays answerable during a
        # run (tests/test_browser.py)
        order = [n for n in ("denoise", "speed", "denoise", "experts", "denoise", "memory") if n in self.views]
        self.pacer = Pacer({name: v.throttle for name, v in self.views.items()}, order or list(self.views), gap=pace,
                           gaps={"denoise": min(pace, 0.15)})
        self.result = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._handle = None  # the running request's Handle
        self._closed = False
        s = engine.settings
        c = engine.model.config
        has_chat = getattr(engine.tokenizer, "chat_template", None) is not None
        chat = chat_format(engine) if chat is None else bool(chat) and has_chat
        wide = {"description_width": "110px"}
        self.prompt = W.Textarea(value=prompt, placeholder="prompt", rows=3, layout=W.Layout(width="98%"))
        self.chat = W.Checkbox(value=chat, description="chat template", disabled=not has_chat, indent=False,
                               layout=W.Layout(width="130px"))
        self.mode = W.ToggleButtons(options=[("block diffusion", "diffusion"), ("AR", "ar"),
                                             ("speculative", "speculative")], value="diffusion",
                                    tooltips=["blocks resolved by previews, under the policy",
                                              "one token per forward", "AR's greedy answer from drafted blocks"],
                                    style={"button_width": "128px"})
        # block diffusion's decoding rule: a registered policy (engine/policies.py) and its settings,
        # in the CLI's --policy form ("k=2", "k=1/2/4", "gamma=0.5"); checked before a run starts
        self.policy = W.Dropdown(options=list(POLICIES), value="threshold", description="policy", style=wide,
                                 layout=W.Layout(width="240px"))
        self.policy_settings = W.Text(value="", placeholder="settings: k=2, gamma=0.5", description="settings",
                                      layout=W.Layout(width="240px"))
        self.threshold = W.FloatSlider(value=s.threshold, min=0.05, max=1.0, step=0.01, description="threshold",
                                       style=wide, readout_format=".2f")
        self.temperature = W.FloatSlider(value=s.temperature, min=0.0, max=2.0, step=0.05, description="temperature",
                                         style=wide)
        self.confidence = W.Dropdown(options=list(CONFIDENCE_RULES), value=s.confidence, description="confidence",
                                     style=wide, layout=W.Layout(width="260px"))
        self.coreset = W.IntSlider(value=s.coreset_size or 0, min=0, max=c.num_experts, description="coreset (0=off)",
                                   style=wide)
        self.max_new_tokens = W.IntSlider(value=max_new_tokens, min=1, max=min(1024, c.max_position_embeddings // 2),
                                          description="max new tokens", style=wide)
        self.generate_button = W.Button(description="Generate", button_style="primary", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.generate_button.on_click(weak_callback(self, "_clicked_generate"))
        self.stop_button.on_click(weak_callback(self, "stop"))
        self.generate_button.add_class("clover-generate")
        self.stop_button.add_class("clover-stop")
        self.status = W.HTML("<span style='color:#666'>ready</span>")
        self.status.add_class("clover-status")
        controls = W.VBox([
            self.prompt,
            W.HBox([self.mode, self.chat, self.threshold, self.temperature], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.policy, self.policy_settings, self.confidence, self.coreset], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.max_new_tokens, self.generate_button, self.stop_button], layout=W.Layout(flex_flow="row wrap")),
            self.status,
        ])
        self.widget = W.VBox([controls] + [v.widget for v in self.views.values()])
        self.widget.add_class("clover-dashboard")

    def __getitem__(self, name: str):
        return self.views[name]

    # ---------------------------------------------------------------- running
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def policy_spec(self) -> str:
        """The picked policy in ``make_policy``'s form: "topk:k=2", "threshold"."""
        settings = self.policy_settings.value.strip()
        return self.policy.value + (f":{settings}" if settings else "")

    def settings(self) -> dict:
        """The controls as keyword arguments of ``engine.generate`` (``policy`` for block
        diffusion only: AR and speculative decode by their own rule)."""
        kwargs = dict(mode=self.mode.value, max_new_tokens=int(self.max_new_tokens.value),
                      threshold=float(self.threshold.value), temperature=float(self.temperature.value),
                      confidence=self.confidence.value, coreset_size=int(self.coreset.value) or None)
        if self.mode.value == "diffusion":
            kwargs["policy"] = self.policy_spec()
        return kwargs

    @staticmethod
    def describe(kwargs: dict) -> str:
        """What a run decodes with, as the views label it: "diffusion · topk:k=2", "ar"."""
        policy = kwargs.get("policy")
        policy = policy if isinstance(policy, str) or policy is None else repr(policy)
        return kwargs["mode"] + (f" · {policy}" if policy else "")

    def _clicked_generate(self, *_) -> None:
        try:
            self.generate()
        except Exception as e:  # noqa: BLE001 - a button has nobody to raise to
            self._set_status(f"<span style='color:#b00'>{html.escape(str(e))}</span>")

    def generate(self, prompt: str | None = None, *, wait: bool = False, **overrides):
        """Start a generation with the controls' settings (``overrides`` replace them) in a
        background thread; with ``wait=True`` return its GenerationResult."""
        if self._closed:
            raise RuntimeError("the dashboard is closed")
        if self.running:
            raise RuntimeError("a generation is running; stop it first")
        if prompt is not None:
            self.prompt.value = prompt
        text = self.prompt.value
        kwargs = {**self.settings(), **overrides}
        if kwargs["mode"] != "diffusion" and "policy" not in overrides:
            kwargs.pop("policy", None)  # mode="ar" given as an override: the picked policy does not apply
        kwargs = settings_for_mode(kwargs["mode"], kwargs)  # AR: the diffusion sliders do not apply
        prompt = [{"role": "user", "content": text}] if self.chat.value else text
        # the engine's one request check: a bad name or setting is an error now, and nothing starts
        handle = self.engine.submit(Request(prompt, **kwargs), emit=False)
        self._handle = handle
        self.result, self.error = None, None
        self.generate_button.disabled = True
        self.stop_button.disabled = False
        self._set_status(f"generating ({html.escape(self.describe(kwargs))}, up to {kwargs['max_new_tokens']} "
                         f"tokens)…")
        self._thread = threading.Thread(target=self._work, args=(handle, kwargs), name="clover-dashboard",
                                        daemon=True)
        self._thread.start()
        if wait:
            return self.wait()
        return None

    def _work(self, handle, kwargs) -> None:
        try:
            result = self.engine.wait(handle)
            self.result = result
            what = self.describe(kwargs)
            if "speed" in self.views:
                speed = self.views["speed"]
                speed.add_result(result, label=f"run {speed.run} · {what}")
            st = result.stats
            self._set_status(f"<b>done</b> ({html.escape(what)}, {st.stop_reason}): {st.new_tokens} tokens in {st.decode_seconds:.2f}s, "
                             f"{st.tokens_per_second:.1f} tokens/s, {st.tokens_per_forward:.2f} tokens per forward, "
                             f"{st.forwards} forwards")
        except BaseException as e:  # noqa: BLE001 - shown, and kept for the caller
            self.error = e
            self._set_status(f"<span style='color:#b00'>failed: {html.escape(type(e).__name__)}: "
                             f"{html.escape(str(e))}</span>")
        finally:
            # the pacer draws each view's last state in its turn: flushing all four here sent the
            # browser every figure at once, just as a person reads the result or clicks
            self.generate_button.disabled = False
            self.stop_button.disabled = True

    def stop(self, *_) -> None:
        """End the running generation at the next step boundary (the blocks committed so far are kept)."""
        if self._handle is not None:
            self._handle.cancel()
        if self.running:
            self._set_status("stopping…")

    def wait(self, timeout: float | None = None):
        """Block until the running generation ends; its GenerationResult (raises what it raised)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the generation is still running after {timeout} s")
            for v in self.views.values():  # whoever waited reads the views: drawn now, not in turn
                v.flush()
        if self.error is not None:
            raise self.error
        return self.result

    def _set_status(self, text: str) -> None:
        self.status.value = text

    # ---------------------------------------------------------------- display, export, close
    async def drawn(self, timeout: float = 15.0, page: float = 5.0) -> bool:
        """``await dash.drawn()``: every view's figures drawn by a page (see ``View.drawn``)."""
        from clover_lab.widgets.figure import figures_drawn

        return await figures_drawn(self.widget, timeout, page)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def export_html(self, path, title: str = "clover_lab dashboard"):
        """Every view in one self-contained HTML file (plotly.js embedded once)."""
        return export_html(list(self.views.values()), path, title)

    def close(self) -> None:
        """Stop a running generation, detach every view and close the widgets."""
        if self.running:
            self.stop()
            self._thread.join()
        self.pacer.close()
        for v in self.views.values():
            v.close()
        self._closed = True
        close_tree(self.widget)
