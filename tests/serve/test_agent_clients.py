"""The client matrix of docs/serving-agents.md: agent frameworks as a user sets them up, against a
live server on 127.0.0.1 (the embedded model in float32), each on ``RUNS`` seeded runs (sampled,
temperature 0.8, seeds 0..RUNS-1), valid on all but at most one. Each is skipped, with the reason,
where its package is not installed (none is in the dev extra but openai); slow tier. The matrix of
docs/serving-agents.md is ``CLOVER_CLIENT_RUNS=8`` (about 4 minutes on the CPU); the slow tier runs
one seeded run per client (``CLOVER_CLIENT_RUNS`` unset: about 40 s), which must be valid."""
import asyncio
import json
import os

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
uvicorn = pytest.importorskip("uvicorn")

NAME = "clover-stdlib"
RUNS = int(os.environ.get("CLOVER_CLIENT_RUNS", "1"))
NEED = RUNS - 1 if RUNS > 1 else 1
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"20 C in {city}"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def valid_runs(run) -> int:
    """How many of RUNS seeded runs ``run(seed)`` returns true (an exception counts as invalid)."""
    ok = 0
    for seed in range(RUNS):
        try:
            ok += bool(run(seed))
        except Exception as e:  # noqa: BLE001 - a client's failure is an invalid run, counted
            print(f"seed {seed}: {type(e).__name__}: {str(e)[:300]}")
    print(f"{run.__qualname__}: {ok}/{RUNS} valid")  # the docs' matrix (pytest -s)
    return ok


def weather_args_valid(args) -> bool:
    jsonschema.validate(args, WEATHER_PARAMS)
    return set(args) == {"city"}  # closed: no key the schema does not list


def test_langchain_bind_tools_and_structured_output_both_methods(base):
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from langchain_openai import ChatOpenAI

    def llm(seed):
        return ChatOpenAI(model=NAME, base_url=base, api_key="none", temperature=0.8, seed=seed, max_tokens=64,
                          max_retries=0, timeout=300, extra_body=OFF)

    def bound(seed):
        reply = llm(seed).bind_tools([get_weather], tool_choice="get_weather").invoke("weather in Paris?")
        return reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather" and weather_args_valid(
            reply.tool_calls[0]["args"])

    assert valid_runs(bound) >= NEED
    for method in ("json_schema", "function_calling"):
        got = valid_runs(lambda seed: isinstance(llm(seed).with_structured_output(Person, method=method).invoke(
            "a person, as JSON"), Person))
        assert got >= NEED, method


def test_langgraph_react_agent_calls_its_tool_when_the_model_must(base):
    """LangGraph's prebuilt agent sends the tools with no tool_choice (auto): the model chooses, and the
    embedded model (trained on Python's standard library, never on tool use) answers in text. A LangGraph
    user who needs the tool binds it with tool_choice "any" (OpenAI's "required") and ends the loop at its
    result (``return_direct``), as LangGraph's guide to forcing tool use says; that is what runs here: the
    tool must be called with valid arguments, and its result end the loop."""
    pytest.importorskip("langgraph", reason="langgraph is not installed")
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    adder = tool(add, return_direct=True)

    def run(seed):
        llm = ChatOpenAI(model=NAME, base_url=base, api_key="none", temperature=0.8, seed=seed, max_tokens=64,
                         max_retries=0, timeout=300, extra_body=OFF)
        agent = create_react_agent(llm.bind_tools([adder], tool_choice="any"), [adder])
        msgs = agent.invoke({"messages": [("user", "What is 2 + 3? Use the add tool.")]},
                            {"recursion_limit": 8})["messages"]
        calls = [c for m in msgs for c in getattr(m, "tool_calls", None) or []]
        return (calls and all(c["name"] == "add" and set(c["args"]) == {"a", "b"}
                              and all(type(v) is int for v in c["args"].values()) for c in calls)
                and isinstance(msgs[-1], ToolMessage)  # the loop ended at the tool's result (return_direct)
                and msgs[-1].content == str(calls[-1]["args"]["a"] + calls[-1]["args"]["b"]))

    assert valid_runs(run) >= NEED


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(base, mode):
    instructor = pytest.importorskip("instructor", reason="instructor is not installed")
    client = instructor.from_openai(openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300),
                                    mode=getattr(instructor.Mode, mode))
    got = valid_runs(lambda seed: isinstance(client.chat.completions.create(
        model=NAME, response_model=Person, messages=[{"role": "user", "content": "a person, as JSON"}],
        max_tokens=64, temperature=0.8, seed=seed, max_retries=0, extra_body=OFF), Person))
    assert got >= NEED


def test_litellm_tools_and_response_format(base):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read as litellm imports: no fetch of its prices
    litellm = pytest.importorskip("litellm", reason="litellm is not installed")
    kw = dict(model=f"openai/{NAME}", api_base=base, api_key="none", max_tokens=64, temperature=0.8,
              extra_body=OFF)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}

    def called(seed):
        r = litellm.completion(messages=[{"role": "user", "content": "weather in Paris?"}], tools=[tool], seed=seed,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
        calls = r.choices[0].message.tool_calls
        return calls and weather_args_valid(json.loads(calls[0].function.arguments))

    def formatted(seed):
        r = litellm.completion(messages=[{"role": "user", "content": "a person, as JSON"}], response_format=Person,
                               seed=seed, **kw)
        return Person.model_validate_json(r.choices[0].message.content)

    assert valid_runs(called) >= NEED and valid_runs(formatted) >= NEED


def test_openai_agents_sdk_default_set_up_uses_responses(base):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed")
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_tracing_disabled(True)

    def run(seed):
        agent = agents.Agent(name="p", instructions="Answer with a person.", model=NAME, output_type=Person,
                             model_settings=agents.ModelSettings(temperature=0.8, max_tokens=64,
                                                                 extra_body={"seed": seed, **OFF}))
        return isinstance(agents.Runner.run_sync(agent, "a person, as JSON").final_output, Person)

    assert isinstance(agents.OpenAIResponsesModel(NAME, client), agents.Model)  # the default set-up's model
    assert valid_runs(run) >= NEED


def test_pydantic_ai_run_and_run_stream(base):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(NAME, provider=OpenAIProvider(base_url=base, api_key="none"))

    def settings(seed):
        return {"temperature": 0.8, "seed": seed, "max_tokens": 64, "extra_body": OFF}

    agent = Agent(model, output_type=Person)
    assert valid_runs(lambda seed: isinstance(agent.run_sync("a person", model_settings=settings(seed)).output,
                                              Person)) >= NEED

    async def streamed(seed):
        async with agent.run_stream("a person", model_settings=settings(seed)) as result:
            return isinstance(await result.get_output(), Person)

    assert valid_runs(lambda seed: asyncio.run(streamed(seed))) >= NEED


def test_smolagents_tool_calling_agent(base):
    smolagents = pytest.importorskip("smolagents", reason="smolagents is not installed")

    @smolagents.tool
    def add_numbers(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return a + b

    def run(seed):
        model = smolagents.OpenAIServerModel(model_id=NAME, api_base=base, api_key="none", temperature=0.8,
                                             seed=seed, max_tokens=64, extra_body=OFF)
        agent = smolagents.ToolCallingAgent(tools=[add_numbers], model=model, max_steps=3, verbosity_level=0)
        agent.run("What is 2 + 3?")
        steps = [s for s in agent.memory.steps if getattr(s, "tool_calls", None)]
        return steps and all(c.name in ("add_numbers", "final_answer") for s in steps for c in s.tool_calls)

    assert valid_runs(run) >= NEED
