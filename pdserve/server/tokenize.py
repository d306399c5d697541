"""`POST /tokenize` and `POST /detokenize` (vLLM's): the engine's own tokenizer and chat template.

Who calls it: `server/api.py` mounts `tokenize_routes` on every engine's app; the PD router forwards
both paths to a live engine. Agents and RL rollout workers that keep a conversation's token ids (so
that each turn's prompt extends the last one's exactly, and hits the prefix cache) render it here:
`messages` go through the same `render_chat` the chat route uses, so `count` equals that route's
`usage.prompt_tokens` for the same messages and tools. Read-only: nothing reaches the engine thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.exceptions import HTTPException

from pdserve.server import tool_calls
from pdserve.server.protocol import ChatMessage
from pdserve.tokenizer import Tokenizer, TokenizerError


def render_chat(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    template_kwargs: dict | None = None,
    documents: list[dict] | None = None,
) -> tuple[str, list[int]]:
    """The chat template applied to `messages` (and `tools`, and the request's chat_template_kwargs),
    and its token ids (`Tokenizer.chat_prompt`). ValueError for a malformed message, TokenizerError
    for a template that refuses it."""
    return tokenizer.chat_prompt(
        tool_calls.template_messages(messages), add_generation_prompt, tools, template_kwargs, documents
    )


class TokenizeRequest(BaseModel):
    """Exactly one of `prompt` (text) or `messages` (a chat, rendered by the template)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # (prompt only: the chat template writes its own)
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # (as the chat route takes them)
    documents: list[dict[str, Any]] | None = None  # (likewise)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


def tokenize_routes(
    tokenizer: Tokenizer | None, max_model_len: int, vocab_size: int, check_model
) -> APIRouter:
    """The two routes for one engine. `check_model(name)` raises the API's 404 for another model."""
    routes = APIRouter()

    def need_tokenizer() -> Tokenizer:
        if tokenizer is None:
            raise HTTPException(400, "this model has no tokenizer")
        return tokenizer

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        tok = need_tokenizer()
        try:
            if body.messages is not None:
                tools = tool_calls.check_tools(body.tools) if body.tools else None
                _, ids = await asyncio.to_thread(
                    render_chat,
                    tok,
                    body.messages,
                    body.add_generation_prompt,
                    tools,
                    body.chat_template_kwargs,
                    body.documents,
                )
            else:
                ids = await asyncio.to_thread(tok.encode, body.prompt, body.add_special_tokens)
        except (TokenizerError, ValueError) as e:
            raise HTTPException(400, str(e)) from None
        out: dict = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        tok = need_tokenizer()
        if not all(0 <= t < vocab_size for t in body.tokens):
            raise HTTPException(400, f"token ids must be in [0, {vocab_size})")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens, False)}

    return routes
