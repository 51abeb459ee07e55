"""The OpenAI API's request bodies as the server accepts them: the shared field types of
engine/server/requests.py (ranges as the CLI's), `extra="forbid"` so a misspelt option is
refused rather than ignored, and OpenAI's own names. Options the server does not implement
(`n` > 1, non-zero presence/frequency penalties, logprobs) are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from engine.server.requests import (
    MaxTokens,
    RepetitionPenalty,
    Schema,
    Seed,
    Temperature,
    TopK,
    TopP,
)

Stop = Union[Annotated[str, Field(max_length=512)],
             Annotated[list[Annotated[str, Field(max_length=512)]], Field(max_length=16)], None]
Zero = Annotated[float, Field(ge=0.0, le=0.0, allow_inf_nan=False)]    # accepted only as 0


class TextPart(Schema):
    type: Literal["text"]
    text: str


class ChatMessage(Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, Annotated[list[TextPart], Field(max_length=256)], None] = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None

    def plain(self) -> dict:
        """{role, content[, name]} as the chat templates read it ("developer" is OpenAI's
        newer name for the system role)."""
        content = self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content or [])
        message = {"role": "system" if self.role == "developer" else self.role,
                   "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class JsonSchemaFormat(Schema):
    name: Annotated[str, Field(max_length=256)] = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Schema):
    include_usage: bool = False


class _Sampling(Schema):
    model: Annotated[str, Field(min_length=1, max_length=512)]
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    repetition_penalty: RepetitionPenalty = 1.0
    seed: Seed = 0
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    presence_penalty: Zero = 0.0
    frequency_penalty: Zero = 0.0
    user: Annotated[str, Field(max_length=256)] | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: MaxTokens | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, Annotated[list[str], Field(min_length=1, max_length=1)]]
    response_format: ResponseFormat | None = None

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class EmbeddingRequest(Schema):
    model: Annotated[str, Field(min_length=1, max_length=512)]
    input: Union[str, Annotated[list[str], Field(min_length=1, max_length=2048)]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
