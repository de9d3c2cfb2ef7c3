"""Google Gemini ``generateContent``: ``POST /rollout/{id}/v1beta/models/{model}:ACTION``
(Gemini CLI, the ``google-genai`` SDKs; ``/v1/models/...`` too).

A Gemini client takes ``{proxy}/rollout/{id}`` as its base URL (``GOOGLE_GEMINI_BASE_URL``)
and appends ``/v1beta/models/{model}:{action}``. Actions: ``generateContent`` (one JSON
response), ``streamGenerateContent`` (with ``?alt=sse``: server-sent ``data:`` events,
each a response chunk; without ``alt``, or ``alt=json``: one JSON array of the chunks),
``countTokens`` (``{"totalTokens": N}``: the prompt as the chat template renders it,
counted; nothing recorded). Any other action is a path the proxy does not serve (404,
kept in the rollout's ``unserved``). The model named in the path is ignored: the proxy
serves its policy. The key comes as ``x-goog-api-key`` (what the SDKs send), ``?key=``
or ``Authorization: Bearer``. Errors have Google's form: ``{"error": {"code": HTTP
status, "message", "status": "INVALID_ARGUMENT" | "UNAUTHENTICATED" | "NOT_FOUND" | ...,
"details": [ErrorInfo {reason: the proxy's code}, BadRequest {fieldViolations: [{field}]}
when a field is named]}}``.

Field names: lowerCamelCase, or snake_case as protobuf's JSON mapping also accepts
(``system_instruction``, ``function_call``...); never inside ``args``, ``response`` and
schemas, which are the client's data.

Input: ``systemInstruction`` (a Content, or a string; its text parts: one system
message), ``contents``: a list of ``{role, parts}`` with role ``user``, ``model`` or
``function`` (as ``user``; a missing role is ``user``). Each part holds exactly one of:
``text`` (``thought: true`` marks a thought: skipped, the proxy never emits any;
``thoughtSignature`` is ignored), ``functionCall`` (``id``, ``name``, ``args`` an object;
model contents only: the turn's tool calls), ``functionResponse`` (``id``, ``name``,
``response`` an object; user contents only: a tool message, in order, before the
content's text; its text is ``response.output`` (or ``response.error``) when that is the
object's only field and a string, else the object as JSON). A model content is one
assistant message (its text parts joined, then its calls); a user content is its tool
messages then one user message of its text parts joined (none when it has only
function responses). Refused (400 naming the part): ``inlineData``, ``fileData``,
``executableCode``, ``codeExecutionResult`` and any other part kind; a part with no kind
or two; ``functionResponse.parts`` (multimodal results); a ``functionCall`` in a user
content or a ``functionResponse`` in a model one; other roles.

Tools: each ``tools[]`` entry's ``functionDeclarations`` (``name``, ``description``, and
``parametersJsonSchema`` (a JSON schema, as given) or ``parameters`` (Gemini's OpenAPI
subset: its upper-case ``type`` values lower-cased, so the template shows JSON schema);
both at once is refused) are served as function tools. Other tools (``googleSearch``,
``codeExecution``, ``urlContext``, ``googleSearchRetrieval``, ``computerUse``...) are
accepted and left out: the model cannot call them (the rollout's
``extra["dropped_tools"]`` lists them by key).

``generationConfig``: ``maxOutputTokens`` is honoured (it only shortens a reply below
the env's limits); ``candidateCount`` > 1 is refused, as is a ``responseModalities``
other than text. Ignored, though type-checked where they are scalars (the env's sampling
applies: the trainer needs the behaviour policy it assumes): ``temperature``, ``topP``,
``topK``, ``seed``, penalties, ``stopSequences``, ``responseMimeType``,
``responseSchema`` / ``responseJsonSchema``, ``thinkingConfig`` (no thoughts are
returned), ``responseLogprobs`` / ``logprobs``, and the rest. Also ignored:
``toolConfig``, ``safetySettings``, ``labels``, ``model``; ``cachedContent`` is refused
(the proxy holds no cached contents). Any other top-level field is ignored.

Output: ``candidates[0].content`` (role ``model``): a ``text`` part (the turn's text, or
its text around the tool-call markup when it made calls; left out when empty and there
are calls), then one ``functionCall`` part per call (``id`` from the proxy, ``args`` an
object: a call whose arguments are not a JSON object gets ``{"input": TEXT}``);
``finishReason`` ``STOP`` (also with calls, as Gemini does) or ``MAX_TOKENS`` (cut at a
limit; the rollout is flagged truncated); ``usageMetadata``
(``promptTokenCount``, ``candidatesTokenCount``, ``totalTokenCount``), ``modelVersion``
(the proxy's model name), ``responseId``. Streamed: one chunk per part, the last with
``finishReason`` and ``usageMetadata``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from environments.blackbox.dialects import (
    Dialect,
    TurnRequest,
    function_tool,
    note_dropped_tools,
    sse,
    validate_json,
)
from environments.blackbox.recorder import (
    InterceptedRollout,
    Message,
    RequestError,
    TurnReply,
    check_object,
    check_text,
    make_message,
    type_name,
)

ACTIONS = ("generateContent", "streamGenerateContent")
"""The actions that record a turn (``countTokens`` counts)."""
PATH = re.compile(r"^/v1(?:beta)?/models/(?P<model>[^/:]+):(?P<action>[A-Za-z]+)$")
"""The path under ``/rollout/{id}`` of a Gemini model call."""
PART_KINDS = ("text", "functionCall", "functionResponse", "inlineData", "fileData",
              "executableCode", "codeExecutionResult")
"""The data fields of a part (a part holds exactly one)."""
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
          404: "NOT_FOUND", 405: "NOT_FOUND", 410: "NOT_FOUND", 413: "INVALID_ARGUMENT",
          429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 502: "UNAVAILABLE",
          503: "UNAVAILABLE"}
FINISH = {"tool_calls": "STOP", "stop": "STOP", "length": "MAX_TOKENS"}
SCHEMA_TYPES = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL",
                "TYPE_UNSPECIFIED"}


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


def camel_keys(value: Any) -> Any:
    """An object's own keys in lowerCamelCase (protobuf JSON takes snake_case too); a
    key given both ways is refused. Values are left as they are."""
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = _camel(key) if isinstance(key, str) else key
        if name in out:
            raise RequestError(f"{key}: given twice (as {name} and {key})", param=str(key))
        out[name] = item
    return out


class GenerationConfig(BaseModel):
    """``generationConfig``: what is read or type-checked (others are ignored)."""

    model_config = ConfigDict(extra="allow")

    maxOutputTokens: int | None = Field(default=None, ge=1)
    candidateCount: int | None = None
    responseModalities: list[str] | None = None
    temperature: float | None = None
    topP: float | None = None
    topK: float | None = None
    seed: int | None = None
    presencePenalty: float | None = None
    frequencyPenalty: float | None = None
    stopSequences: list[str] | None = None
    responseMimeType: str | None = None
    responseLogprobs: bool | None = None
    logprobs: int | None = None
    thinkingConfig: dict[str, Any] | None = None


class GenerateContentRequest(BaseModel):
    """A ``generateContent`` body (keys already in lowerCamelCase)."""

    model_config = ConfigDict(extra="allow")

    contents: list[Any] = Field(min_length=1)
    systemInstruction: dict[str, Any] | str | None = None
    tools: list[Any] | None = None
    toolConfig: dict[str, Any] | None = None
    generationConfig: dict[str, Any] | None = None
    safetySettings: list[Any] | None = None
    cachedContent: str | None = None
    labels: dict[str, str] | None = None
    model: str | None = None


class CountTokensRequest(BaseModel):
    """A ``countTokens`` body: ``contents``, or a whole ``generateContentRequest``."""

    model_config = ConfigDict(extra="allow")

    contents: list[Any] | None = None
    generateContentRequest: dict[str, Any] | None = None


def _validated(model: type[BaseModel], raw: bytes) -> Any:
    """``raw`` read into ``model`` after its top-level keys are put in lowerCamelCase."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None  # validate_json says what is wrong with it
    if isinstance(body, dict):
        raw = json.dumps(camel_keys(body)).encode()
    return validate_json(model, raw)


def _part_kind(part: dict[str, Any], where: str) -> str:
    kinds = [k for k in part if k in PART_KINDS]
    if len(kinds) != 1:
        what = " and ".join(kinds) or f"none (its fields: {', '.join(map(str, part)) or '-'})"
        raise RequestError(f"{where}: a part holds exactly one of text, functionCall, "
                           f"functionResponse; it has {what}", param=where)
    kind = kinds[0]
    if kind not in ("text", "functionCall", "functionResponse"):
        raise RequestError(f"{where}.{kind}: only text, functionCall and functionResponse "
                           "parts are supported", param=f"{where}.{kind}")
    return kind


def _response_text(response: Any, where: str) -> str:
    """A function response's ``response`` as the tool message's text."""
    check_object(response, where)
    if len(response) == 1:
        [(key, value)] = response.items()
        if key in ("output", "error") and isinstance(value, str):
            return value
    return json.dumps(response, ensure_ascii=False)


def _content(content: Any, index: int, messages: list[Message]) -> None:
    """Append the messages of ``contents[index]``."""
    where = f"contents[{index}]"
    content = camel_keys(check_object(content, where, "a Content object"))
    role = content.get("role") or "user"
    if role not in ("user", "model", "function"):
        raise RequestError(f"{where}.role: {role!r} is not user, model or function",
                           param=f"{where}.role")
    parts = content.get("parts")
    if not isinstance(parts, list):
        raise RequestError(f"{where}.parts: must be an array of parts, got "
                           f"{type_name(parts)}", param=f"{where}.parts")
    texts, calls, results = [], [], []
    for i, part in enumerate(parts):
        at = f"{where}.parts[{i}]"
        part = camel_keys(check_object(part, at, "a Part object"))
        kind = _part_kind(part, at)
        if kind == "text":
            text = check_text(part["text"], f"{at}.text")
            if part.get("thought") is not None and not isinstance(part["thought"], bool):
                raise RequestError(f"{at}.thought: must be a boolean, got "
                                   f"{type_name(part['thought'])}", param=f"{at}.thought")
            if not part.get("thought"):
                texts.append(text)
        elif kind == "functionCall":
            if role != "model":
                raise RequestError(f"{at}.functionCall: only model contents have function "
                                   "calls", param=f"{at}.functionCall")
            call = camel_keys(check_object(part["functionCall"], f"{at}.functionCall"))
            name = check_text(call.get("name"), f"{at}.functionCall.name")
            if call.get("id") is not None:
                check_text(call["id"], f"{at}.functionCall.id")
            args = check_object(call.get("args", {}), f"{at}.functionCall.args")
            calls.append((call.get("id"), name, args))
        else:
            if role == "model":
                raise RequestError(f"{at}.functionResponse: model contents have no function "
                                   "responses", param=f"{at}.functionResponse")
            result = camel_keys(check_object(part["functionResponse"],
                                             f"{at}.functionResponse"))
            name = check_text(result.get("name"), f"{at}.functionResponse.name")
            if result.get("id") is not None:
                check_text(result["id"], f"{at}.functionResponse.id")
            if result.get("parts"):
                raise RequestError(f"{at}.functionResponse.parts: multimodal function "
                                   "responses are not supported",
                                   param=f"{at}.functionResponse.parts")
            results.append(make_message(
                "tool", _response_text(result.get("response", {}),
                                       f"{at}.functionResponse.response"),
                tool_call_id=result.get("id"), name=name))
    text = "".join(texts)
    if role == "model":
        messages.append(make_message("assistant", text, calls))
    else:
        messages += results
        if texts or not results:
            messages.append(make_message("user", text))


def _system(instruction: dict[str, Any] | str) -> str:
    if isinstance(instruction, str):
        return instruction
    instruction = camel_keys(instruction)
    parts = instruction.get("parts")
    if not isinstance(parts, list):
        raise RequestError(f"systemInstruction.parts: must be an array of parts, got "
                           f"{type_name(parts)}", param="systemInstruction.parts")
    texts = []
    for i, part in enumerate(parts):
        at = f"systemInstruction.parts[{i}]"
        part = camel_keys(check_object(part, at, "a Part object"))
        if _part_kind(part, at) != "text":
            raise RequestError(f"{at}: only text parts are supported in the system "
                               "instruction", param=at)
        if not part.get("thought"):
            texts.append(check_text(part["text"], f"{at}.text"))
    return "".join(texts)


def openapi_to_json_schema(schema: Any) -> Any:
    """Gemini's ``parameters`` (an OpenAPI subset, ``"type": "OBJECT"``) as JSON schema:
    upper-case ``type`` values lower-cased, in nested ``properties``, ``items``,
    ``anyOf``; everything else as given."""
    if isinstance(schema, list):
        return [openapi_to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kind = out.get("type")
    if isinstance(kind, str) and kind.upper() in SCHEMA_TYPES and kind.isupper():
        if kind == "TYPE_UNSPECIFIED":
            del out["type"]
        else:
            out["type"] = kind.lower()
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: openapi_to_json_schema(v)
                             for k, v in out["properties"].items()}
    for key in ("items", "anyOf"):
        if key in out:
            out[key] = openapi_to_json_schema(out[key])
    return out


def function_tools(tools: list[Any] | None) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """The function declarations as chat-form tools, and the keys of tools left out."""
    served, dropped = [], []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        tool = camel_keys(check_object(tool, where, "a Tool object"))
        for key, value in tool.items():
            if key != "functionDeclarations":
                dropped.append(key)
                continue
            if not isinstance(value, list):
                raise RequestError(f"{where}.functionDeclarations: must be an array, got "
                                   f"{type_name(value)}", param=f"{where}.functionDeclarations")
            for j, declaration in enumerate(value):
                at = f"{where}.functionDeclarations[{j}]"
                declaration = camel_keys(check_object(declaration, at))
                schema, plain = (declaration.get("parametersJsonSchema"),
                                 declaration.get("parameters"))
                if schema is not None and plain is not None:
                    raise RequestError(f"{at}: parameters and parametersJsonSchema are "
                                       "mutually exclusive", param=f"{at}.parameters")
                if plain is not None:
                    check_object(plain, f"{at}.parameters", "a Schema object")
                    schema = openapi_to_json_schema(plain)
                served.append(function_tool(declaration.get("name"),
                                            declaration.get("description"), schema, at))
    return served or None, dropped


def _parse(body: GenerateContentRequest, rollout: InterceptedRollout
           ) -> tuple[list[Message], list[dict[str, Any]] | None]:
    if body.cachedContent is not None:
        raise RequestError("cachedContent: the proxy holds no cached contents; send the "
                           "whole conversation", param="cachedContent")
    messages: list[Message] = []
    if body.systemInstruction:
        text = _system(body.systemInstruction)
        if text:
            messages.append(make_message("system", text))
    for i, content in enumerate(body.contents):
        _content(content, i, messages)
    tools, dropped = function_tools(body.tools)
    note_dropped_tools(rollout, dropped)
    return messages, tools


def _generation_config(raw: dict[str, Any] | None) -> GenerationConfig:
    if raw is None:
        return GenerationConfig()
    try:
        config = GenerationConfig.model_validate(camel_keys(raw))
    except ValueError as error:  # pydantic's ValidationError
        first = error.errors()[0]  # type: ignore[attr-defined]
        where = "generationConfig" + "".join(f".{x}" for x in first["loc"][:1])
        raise RequestError(f"{where}: {first['msg']}", param=where) from None
    if (config.candidateCount or 1) != 1:
        raise RequestError(f"generationConfig.candidateCount: only 1 candidate per request "
                           f"is supported, got {config.candidateCount}",
                           param="generationConfig.candidateCount")
    if config.responseModalities and set(m.upper() for m in config.responseModalities) != {
            "TEXT"}:
        raise RequestError("generationConfig.responseModalities: only TEXT is supported, got "
                           f"{config.responseModalities}",
                           param="generationConfig.responseModalities")
    return config


class GeminiDialect(Dialect):
    name = "gemini"
    path = "/v1beta/models/{call}"
    """``{call}`` is ``MODEL:ACTION`` (also served under ``/v1/``)."""

    def routes(self) -> list[str]:
        return [self.path, "/v1/models/{call}"]

    def matches(self, path: str) -> bool:
        match = PATH.match(path)
        return bool(match) and match["action"] in ACTIONS

    def kind(self, request: Any) -> str | None:
        action = request.match_info["call"].rpartition(":")[2]
        return "turn" if action in ACTIONS else "count" if action == "countTokens" else None

    def request_options(self, request: Any) -> dict[str, Any]:
        return {"action": request.match_info["call"].rpartition(":")[2],
                "alt": request.query.get("alt")}

    def call_id(self, turn: int, j: int) -> str:
        return f"call_{turn}_{j}"

    def parse(self, raw: bytes, rollout: InterceptedRollout, action: str = "generateContent",
              alt: str | None = None) -> TurnRequest:
        if alt not in (None, "sse", "json"):
            raise RequestError(f"alt: {alt!r} is not sse or json", param="alt")
        body = _validated(GenerateContentRequest, raw)
        config = _generation_config(body.generationConfig)
        messages, tools = _parse(body, rollout)
        stream = action == "streamGenerateContent"
        return TurnRequest(messages, tools, config.maxOutputTokens, stream and alt == "sse",
                           body, json_stream=stream and alt != "sse")

    def count(self, raw: bytes, rollout: InterceptedRollout
              ) -> tuple[list[Message], list[dict[str, Any]] | None]:
        body = _validated(CountTokensRequest, raw)
        if body.generateContentRequest is not None:
            if body.contents is not None:
                raise RequestError("contents and generateContentRequest are mutually "
                                   "exclusive", param="contents")
            inner = validate_json(GenerateContentRequest, json.dumps(
                camel_keys(body.generateContentRequest)).encode())
            return _parse(inner, rollout)
        if not body.contents:
            raise RequestError("contents: required (or generateContentRequest)",
                               param="contents")
        return _parse(GenerateContentRequest(contents=body.contents), rollout)

    def count_body(self, n: int) -> dict[str, Any]:
        return {"totalTokens": n}

    def error_body(self, message: str, code: str, kind: str, param: str | None,
                   status: int = 400) -> dict:
        details: list[dict[str, Any]] = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                                          "reason": code, "domain": "lachesis"}]
        if param:
            details.append({"@type": "type.googleapis.com/google.rpc.BadRequest",
                            "fieldViolations": [{"field": param, "description": message}]})
        return {"error": {"code": status, "message": message,
                          "status": STATUS.get(status, "UNKNOWN"), "details": details}}

    def reply(self, request: TurnRequest, turn: TurnReply, model: str,
              rollout: InterceptedRollout) -> Any:
        parts: list[dict[str, Any]] = []
        if turn.content or not turn.calls:
            parts.append({"text": turn.content})
        for call in turn.calls:
            args = call.arguments if isinstance(call.arguments, dict) else {
                "input": call.arguments}
            parts.append({"functionCall": {"id": call.id, "name": call.name, "args": args}})
        reply = {"candidates": [{"content": {"role": "model", "parts": parts},
                                 "finishReason": FINISH[turn.finish], "index": 0}],
                 "usageMetadata": {"promptTokenCount": turn.prompt_tokens,
                                   "candidatesTokenCount": turn.completion_tokens,
                                   "totalTokenCount": turn.prompt_tokens
                                   + turn.completion_tokens},
                 "modelVersion": model, "responseId": f"{rollout.id[:12]}{turn.index:04d}"}
        if request.json_stream:
            return self.chunks(reply)
        return reply

    @staticmethod
    def chunks(reply: dict[str, Any]) -> list[dict[str, Any]]:
        """The reply as stream chunks: one per part, the last with ``finishReason`` and
        ``usageMetadata``."""
        candidate = reply["candidates"][0]
        parts = candidate["content"]["parts"]
        out = []
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            chunk_candidate = {"content": {"role": "model", "parts": [part]}, "index": 0}
            if last:
                chunk_candidate["finishReason"] = candidate["finishReason"]
            out.append({"candidates": [chunk_candidate],
                        **({"usageMetadata": reply["usageMetadata"]} if last else {}),
                        "modelVersion": reply["modelVersion"],
                        "responseId": reply["responseId"]})
        return out

    def events(self, request: TurnRequest, reply: dict[str, Any]) -> list[bytes]:
        return [sse(chunk) for chunk in self.chunks(reply)]
