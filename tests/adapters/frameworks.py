"""Scripted models each framework accepts (its own Model / client classes), used by the adapter
tests to produce REAL framework records: smolagents (Model subclass), AG2 (custom ModelClient),
OpenAI Agents SDK (Model subclass), OpenTelemetry SDK (a tracer writing GenAI spans)."""

from __future__ import annotations

import json


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
