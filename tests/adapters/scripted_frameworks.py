"""Scripted models each framework accepts (its own Model / client classes), used by the adapter
tests to produce REAL framework records: smolagents (Model subclass), AG2 (custom ModelClient),
OpenAI Agents SDK (Model subclass), OpenTelemetry SDK (a tracer writing GenAI spans)."""

from __future__ import annotations

import json

import pytest


def smolagents_model(script):
    """A smolagents Model answering with `script` in order: each item is ("text", str) or
    ("call", tool_name, arguments_dict)."""
    from smolagents.models import (ChatMessage, ChatMessageToolCall, ChatMessageToolCallFunction,
                                   MessageRole, Model, TokenUsage)

    class Scripted(Model):
        def __init__(self):
            super().__init__(model_id="scripted")
            self.i = 0

        def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kw):
            item = script[self.i]
            self.i += 1
            usage = TokenUsage(input_tokens=10, output_tokens=5)
            if item[0] == "text":
                return ChatMessage(role=MessageRole.ASSISTANT, content=item[1], token_usage=usage)
            return ChatMessage(role=MessageRole.ASSISTANT, content=None, token_usage=usage, tool_calls=[
                ChatMessageToolCall(id=f"call_{self.i}", type="function",
                                    function=ChatMessageToolCallFunction(name=item[1], arguments=item[2]))])

    return Scripted()


def smolagents_tools():
    from smolagents import tool

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return a * b

    @tool
    def lookup(city: str) -> str:
        """Look up a city's population.

        Args:
            city: the city name
        """
        if city == "Atlantis":
            raise ValueError("no such city")
        return f"{city}: 2.1 million"

    return [multiply, lookup]


SMOL_SCRIPT = [
    ("call", "multiply", {"a": 17, "b": 24}),
    ("call", "lookup", {"city": "Atlantis"}),
    ("call", "lookup", {"city": "Paris"}),
    ("call", "final_answer", {"answer": "408 pens; Paris: 2.1 million"}),
]


class _Msg(dict):
    """An OpenAI-style chat message: a dict (what AG2 stores) with attribute access."""

    def __init__(self, content=None, tool_calls=None):
        super().__init__(content=content, role="assistant", function_call=None)
        if tool_calls:
            self["tool_calls"] = tool_calls

    def __getattr__(self, k):
        if k in ("content", "role", "function_call", "tool_calls"):
            return self.get(k)
        raise AttributeError(k)


class _Choice:
    def __init__(self, msg):
        self.message, self.finish_reason = msg, "tool_calls" if msg.tool_calls else "stop"


class _Resp:
    def __init__(self, msg, model):
        self.choices, self.model, self.cost, self.usage = [_Choice(msg)], model, 0.0, {}


AG2_SCRIPTS: dict[str, list] = {}


class AG2ScriptedClient:
    """An AG2 custom ModelClient (`model_client_cls`): answers each agent's turn from
    AG2_SCRIPTS[model] in order: ("text", str) or ("call", id, tool, arguments)."""

    def __init__(self, config, **kwargs):
        self.model = config["model"]

    def create(self, params):
        item = AG2_SCRIPTS[self.model].pop(0)
        if item[0] == "text":
            return _Resp(_Msg(content=item[1]), self.model)
        return _Resp(_Msg(tool_calls=[{"id": item[1], "type": "function",
                                       "function": {"name": item[2], "arguments": json.dumps(item[3])}}]), self.model)

    def message_retrieval(self, response):
        return [c.message for c in response.choices]

    def cost(self, response):
        return 0.0

    @staticmethod
    def get_usage(response):
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cost": 0.0, "model": response.model}


def ag2_llm_config(model: str) -> dict:
    return {"config_list": [{"model": model, "model_client_cls": "AG2ScriptedClient", "api_key": "none"}],
            "cache_seed": None}


def openai_agents_model(script, *, responses_api: bool = False):
    """An OpenAI Agents SDK Model answering from `script` in order: ("text", str) or
    ("call", call_id, tool, arguments). Like the SDK's chat-completions model it records each
    answer in a generation span, so the trace holds what the model said; with `responses_api`
    it traces as the SDK's default `OpenAIResponsesModel` does: a response span keeping only the
    response (exported as its id)."""
    from agents import Model, ModelResponse, Usage
    from agents.tracing import generation_span
    from openai.types.responses import (ResponseFunctionToolCall, ResponseOutputMessage,
                                        ResponseOutputText)

    class Scripted(Model):
        def __init__(self):
            self.i = 0

        async def get_response(self, system_instructions, input, model_settings, tools, output_schema,
                               handoffs, tracing, *, previous_response_id=None, conversation_id=None,
                               prompt=None):
            item = script[self.i]
            self.i += 1
            if responses_api:
                return self._responses(item)
            with generation_span(model="scripted", input=input if isinstance(input, list) else
                                 [{"role": "user", "content": input}]) as span:
                if item[0] == "text":
                    out = [ResponseOutputMessage(id=f"msg_{self.i}", type="message", role="assistant",
                                                 status="completed", content=[ResponseOutputText(
                                                     type="output_text", text=item[1], annotations=[])])]
                    span.span_data.output = [{"role": "assistant", "content": item[1]}]
                else:
                    out = [ResponseFunctionToolCall(id=f"fc_{self.i}", call_id=item[1], type="function_call",
                                                    name=item[2], arguments=json.dumps(item[3]))]
                    span.span_data.output = [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": item[1], "type": "function",
                         "function": {"name": item[2], "arguments": json.dumps(item[3])}}]}]
                span.span_data.usage = {"input_tokens": 10, "output_tokens": 5}
            return ModelResponse(output=out, usage=Usage(requests=1, input_tokens=10, output_tokens=5,
                                                         total_tokens=15), response_id=f"resp_{self.i}")

        def _responses(self, item):
            from agents.tracing import response_span
            from openai.types.responses import Response
            if item[0] == "text":
                out = [ResponseOutputMessage(id=f"msg_{self.i}", type="message", role="assistant",
                                             status="completed", content=[ResponseOutputText(
                                                 type="output_text", text=item[1], annotations=[])])]
            else:
                out = [ResponseFunctionToolCall(id=f"fc_{self.i}", call_id=item[1], type="function_call",
                                                name=item[2], arguments=json.dumps(item[3]))]
            with response_span() as span:        # what OpenAIResponsesModel records
                span.span_data.response = Response(id=f"resp_{self.i}", created_at=0, model="scripted",
                                                   object="response", output=out, parallel_tool_calls=False,
                                                   tool_choice="auto", tools=[])
            return ModelResponse(output=out, usage=Usage(requests=1, input_tokens=10, output_tokens=5,
                                                         total_tokens=15), response_id=f"resp_{self.i}")

        def stream_response(self, *a, **kw):
            raise NotImplementedError("the scripted model does not stream")

    return Scripted()


def openai_agents_triage():
    """The Agents SDK's own classes: a triage agent handing off to a math agent that calls its
    `multiply` tool and answers "408 pens" (a scripted model; the SDK's exporter off).
    Returns (triage agent, model)."""
    pytest.importorskip("agents")
    from agents import Agent, function_tool, set_trace_processors
    set_trace_processors([])          # the SDK's default exporter would post to OpenAI

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b
    model = openai_agents_model([("call", "call_h", "transfer_to_math", {}),
                                 ("call", "call_m", "multiply", {"a": 17, "b": 24}), ("text", "408 pens")])
    math = Agent(name="math", instructions="do math", tools=[multiply], model=model)
    return Agent(name="triage", instructions="route", handoffs=[math], model=model), model


class TraceCollector:
    """An OpenAI Agents SDK TracingProcessor keeping every trace and span export (the SDK's own
    export format, as a file exporter would write it)."""

    def __init__(self):
        self.records: list[dict] = []

    def on_trace_start(self, trace):
        pass

    def on_trace_end(self, trace):
        self.records.append(trace.export())

    def on_span_start(self, span):
        pass

    def on_span_end(self, span):
        self.records.append(span.export())

    def shutdown(self):
        pass

    def force_flush(self):
        pass


def otel_agent_run(exporter_provider):
    """Spans an instrumented two-agent run writes with the OpenTelemetry SDK, following the GenAI
    semantic conventions: invoke_agent(planner) > chat, invoke_agent(calc) > chat, execute_tool
    (one failing), chat. Returns nothing; the spans are in the provider's exporter."""
    from opentelemetry.trace import Status, StatusCode
    tracer = exporter_provider.get_tracer("scripted-agent")

    def msgs(role, *parts):
        return json.dumps([{"role": role, "parts": list(parts)}])

    def text(t):
        return {"type": "text", "content": t}

    def call(i, n, a):
        return {"type": "tool_call", "id": i, "name": n, "arguments": a}

    with tracer.start_as_current_span("invoke_agent planner", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "planner",
            "gen_ai.output.messages": msgs("assistant", text("408 pens"))}):
        with tracer.start_as_current_span("chat scripted", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "scripted",
                "gen_ai.input.messages": msgs("user", text("How many pens in 17 boxes of 24?")),
                "gen_ai.output.messages": msgs("assistant", text("Ask calc to multiply.")),
                "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 4}):
            pass
        with tracer.start_as_current_span("invoke_agent calc", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "calc"}):
            with tracer.start_as_current_span("chat scripted", attributes={
                    "gen_ai.operation.name": "chat", "gen_ai.response.id": "r1",
                    "gen_ai.output.messages": msgs("assistant", call("c1", "lookup", {"city": "Atlantis"}),
                                                   call("c2", "multiply", {"a": 17, "b": 24}))}):
                pass
            with tracer.start_as_current_span("execute_tool lookup", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
                    "gen_ai.tool.call.id": "c1"}) as sp:
                sp.set_status(Status(StatusCode.ERROR, "no such city"))
            with tracer.start_as_current_span("execute_tool multiply", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "multiply",
                    "gen_ai.tool.call.id": "c2", "gen_ai.tool.call.result": "408"}):
                pass
            with tracer.start_as_current_span("chat scripted", attributes={
                    "gen_ai.operation.name": "chat",
                    "gen_ai.output.messages": msgs("assistant", text("17 * 24 = 408"))}):
                pass


def ag2_groupchat():
    pytest.importorskip("autogen")
    from autogen import ConversableAgent, GroupChat, GroupChatManager, UserProxyAgent
    AG2_SCRIPTS.clear()
    AG2_SCRIPTS.update({"planner": [("text", "Plan: multiply 17 by 24."), ("text", "Report the total.")],
                           "calc": [("call", "call_a", "multiply", {"a": 17, "b": 24}),
                                    ("text", "17 * 24 = 408. TERMINATE")]})

    def term(m):
        return "TERMINATE" in (m.get("content") or "")

    planner = ConversableAgent("planner", llm_config=ag2_llm_config("planner"), human_input_mode="NEVER")
    calc = ConversableAgent("calc", llm_config=ag2_llm_config("calc"), human_input_mode="NEVER")
    executor = UserProxyAgent("executor", human_input_mode="NEVER", code_execution_config=False,
                              is_termination_msg=term)

    def multiply(a: int, b: int) -> int:
        return a * b
    calc.register_for_llm(name="multiply", description="multiply two integers")(multiply)
    executor.register_for_execution(name="multiply")(multiply)
    for ag in (planner, calc):
        ag.register_model_client(model_client_cls=AG2ScriptedClient)
    gc = GroupChat(agents=[executor, planner, calc], messages=[], max_round=8,
                   speaker_selection_method="round_robin")
    mgr = GroupChatManager(gc, llm_config=False, is_termination_msg=term)
    return executor, mgr, gc, (planner, calc)


def agentchat_client(script):
    """An AutoGen AgentChat ChatCompletionClient answering from `script` in order: ("text", str)
    or ("call", call_id, tool, arguments)."""
    from autogen_core import FunctionCall
    from autogen_core.models import ChatCompletionClient, CreateResult, ModelInfo, RequestUsage

    class Scripted(ChatCompletionClient):
        def __init__(self):
            self.i = 0

        async def create(self, messages, *, tools=(), tool_choice="auto", json_output=None, extra_create_args=None,
                         cancellation_token=None):
            item = script[self.i]
            self.i += 1
            usage = RequestUsage(prompt_tokens=10, completion_tokens=5)
            if item[0] == "text":
                return CreateResult(finish_reason="stop", content=item[1], usage=usage, cached=False)
            return CreateResult(finish_reason="function_calls", usage=usage, cached=False,
                                content=[FunctionCall(id=item[1], name=item[2], arguments=json.dumps(item[3]))])

        def create_stream(self, *a, **kw):
            raise NotImplementedError("the scripted client does not stream")

        async def close(self):
            pass

        def actual_usage(self):
            return RequestUsage(prompt_tokens=0, completion_tokens=0)

        total_usage = actual_usage

        def count_tokens(self, messages, *, tools=()):
            return 0

        def remaining_tokens(self, messages, *, tools=()):
            return 100000

        @property
        def capabilities(self):
            return self.model_info

        @property
        def model_info(self):
            return ModelInfo(vision=False, function_calling=True, json_output=False, family="unknown",
                             structured_output=False)

    return Scripted()


def smolagents_openai_server_model(script):
    """smolagents' own `OpenAIServerModel` with an offline chat-completions client answering from
    `script` (items as for `smolagents_model`): the model class instrumentors (OpenInference)
    know, so its calls are traced as LLM spans."""
    from openai.types.chat import ChatCompletion, ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice
    from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall, Function
    from openai.types.completion_usage import CompletionUsage
    from smolagents import OpenAIServerModel

    class Completions:
        def __init__(self):
            self.i = 0

        def create(self, **kw):
            item = script[self.i]
            self.i += 1
            if item[0] == "text":
                msg = ChatCompletionMessage(role="assistant", content=item[1])
            else:
                msg = ChatCompletionMessage(role="assistant", content=None, tool_calls=[ChatCompletionMessageToolCall(
                    id=f"call_{self.i}", type="function",
                    function=Function(name=item[1], arguments=json.dumps(item[2])))])
            return ChatCompletion(id=f"cc_{self.i}", object="chat.completion", created=0, model="scripted",
                                  choices=[Choice(index=0, message=msg,
                                                  finish_reason="stop" if item[0] == "text" else "tool_calls")],
                                  usage=CompletionUsage(prompt_tokens=10, completion_tokens=5, total_tokens=15))

    class Client:
        def __init__(self):
            self.chat = type("Chat", (), {})()
            self.chat.completions = Completions()

    model = OpenAIServerModel(model_id="scripted", api_base="http://offline.invalid/v1", api_key="none")
    model.client = Client()
    return model
