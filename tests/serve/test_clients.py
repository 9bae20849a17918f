"""Agent frameworks' structured output and tools against a live server on 127.0.0.1 (the embedded
model in float32): the openai client's ``chat.completions.parse`` with a pydantic model, LangChain's
``ChatOpenAI(...).with_structured_output(schema)`` (OpenAI's json_schema, strict) and
``.bind_tools([...], tool_choice=...)``; whatever the model writes, the grammar makes it parse into
the schema. LangChain's tests skip where ``langchain-openai`` is not installed."""

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

import clover_lab

uvicorn = pytest.importorskip("uvicorn")

NAME = "clover-stdlib"


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_openai_parse_gives_the_pydantic_model(base):
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)
    r = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "a person, as JSON"}],
                                      response_format=Person, max_tokens=96, temperature=0, extra_body=NO_THINKING)
    assert isinstance(r.choices[0].message.parsed, Person), r.choices[0].message


def test_langchain_structured_output_and_bound_tools(base):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=NAME, base_url=base, api_key="none", temperature=0, max_tokens=96, max_retries=0,
                     timeout=300, extra_body=NO_THINKING)
    person = llm.with_structured_output(Person).invoke("a person, as JSON")
    assert isinstance(person, Person)

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city, in unit C or F."""
        return f"20 {unit} in {city}"

    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather", reply
    args = reply.tool_calls[0]["args"]  # valid against the tool's schema (which, not strict, allows more keys)
    jsonschema.validate(args, convert_to_openai_tool(get_weather)["function"]["parameters"])
    assert {"city", "unit"} <= set(args)
    assert get_weather.invoke(args)  # the call runs as LangChain would run it


def test_lm_eval_loglikelihood_through_its_own_client(base):
    """examples/lm_eval_loglikelihood.py: lm-eval's LocalCompletionsAPI scores each choice; its
    log-likelihoods are the engine's scoring of the same tokens (Request(prompt_logprobs=0))."""
    pytest.importorskip("lm_eval")
    import importlib.util
    from pathlib import Path

    from clover_lab.checkpoint.loading import model_path
    from clover_lab.engine.requests import Request

    path = Path(__file__).resolve().parents[2] / "examples" / "lm_eval_loglikelihood.py"
    spec = importlib.util.spec_from_file_location("lm_eval_loglikelihood", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.run(base[:-len("/v1")] + "/v1", NAME, str(model_path()))
    engine = clover_lab.load(dtype=torch.float32)
    for row in rows:
        for choice, value in zip(row["choices"], row["loglikelihood"]):
            ctx = engine.encode(row["context"])
            whole = engine.encode(row["context"] + choice)
            ref = engine.generate(Request(whole, max_new_tokens=0, prompt_logprobs=0))
            # lm-eval splits context and continuation at the context's tokens
            assert value == pytest.approx(sum(ref.prompt_logprobs[len(ctx):]), abs=1e-3), (row, choice)
    assert sum(r["pick"] == r["right"] for r in rows) >= len(rows) // 2
