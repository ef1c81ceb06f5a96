"""One choice of an OpenAI response, built as the engine's outputs for its request arrive.

A request with `n` > 1 (or `best_of`) is that many engine requests with the
same prompt, one `Choice` each; the stream interleaves their chunks by
`index`, and the whole response lists them in order. A choice renders its
text (after the echoed prompt, for completions with `echo`), its logprobs in
the endpoint's shape, and its tool calls (chat with tools).
"""

from __future__ import annotations

from gpuservd.api import responses, tools
from gpuservd.api.protocol import GenerationRequest
from gpuservd.serving.request_stream import ActiveRequest


class Choice:
    """The state of one choice: what it produced so far and how to render it."""

    def __init__(self, index: int, active: ActiveRequest, greq: GenerationRequest, created: int,
                 logprobs: bool):
        self.index = index
        self.active = active
        self.greq = greq
        self.created = created
        self.want_logprobs = logprobs  # the client asked (best_of may collect them only to rank)
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # sampler.TokenLogprobs, one per token
        self.prompt_logprobs: list | None = None  # echo with logprobs: one per prompt token (None first)
        self.sum_logprob = 0.0  # for best_of
        self.echo = self._echo_text() if greq.echo else ""
        self.offset = len(self.echo)  # text_offset of the next token (completions logprobs)
        constrained = greq.tool_choice == "required" or isinstance(greq.tool_choice, dict)
        use_tools = greq.kind == "chat" and greq.tools and greq.tool_choice != "none"
        self.tool_stream = tools.ToolStream(greq.tools, constrained, greq.parallel_tool_calls) if use_tools else None
        self.encoder = responses.ChunkEncoder(greq.kind, active.ctx.request_id, greq.model, created,
                                              greq.return_token_ids, greq.include_usage, index)

    def _echo_text(self) -> str:
        if self.greq.prompt is not None:
            return self.greq.prompt
        return self.active.slot.tokenizer.decode(self.greq.prompt_token_ids or [], skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.active.slot.tokenizer.decode([token_id])

    def add(self, outs) -> tuple[str, list[int], list]:
        """Take a batch of RequestOutputs; returns its (text, token ids, logprob entries)."""
        text = "".join(o.new_text for o in outs)
        ids = [t for o in outs for t in o.new_token_ids]
        lps = [e for o in outs if o.logprobs for e in o.logprobs]
        for o in outs:
            if o.prompt_logprobs is not None:
                self.prompt_logprobs = o.prompt_logprobs
        self.text.append(text)
        self.token_ids += ids
        self.logprobs += lps
        self.sum_logprob += sum(e.logprob for e in lps)
        return text, ids, lps

    def _render_logprobs(self, entries: list) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.greq.kind == "chat":
            return responses.chat_logprobs(entries, self.token_text)
        out = responses.completion_logprobs(entries, self.token_text, self.offset)
        return out

    def _with_prompt(self, out: dict | None) -> dict | None:
        """Completions' logprobs with the echoed prompt's in front: as OpenAI's legacy completions give
        them, the first prompt token's logprob and alternatives are null."""
        if out is None or not self.prompt_logprobs:
            return out
        tokens, offsets, offset = [], [], 0
        for tid in self.active.prompt_token_ids:
            tokens.append(self.token_text(tid))
            offsets.append(offset)
            offset += len(tokens[-1])
        rest = responses.completion_logprobs([e for e in self.prompt_logprobs[1:]], self.token_text)
        return {"tokens": tokens + out["tokens"],
                "token_logprobs": [None] + rest["token_logprobs"] + out["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"] + out["top_logprobs"],
                "text_offset": offsets + out["text_offset"]}

    # ---- streaming ------------------------------------------------------------------------------
    def opening(self) -> bytes | None:
        """Chat's first chunk (the role) for this choice."""
        if self.greq.kind != "chat":
            return None
        return responses.sse(responses.stream_chunk("chat", self.active.ctx.request_id, self.greq.model,
                                                    self.created, "", role=True,
                                                    include_usage=self.greq.include_usage, index=self.index))

    def chunk(self, outs) -> bytes | None:
        """The SSE chunk for a batch of this choice's outputs (None when there is nothing to send yet)."""
        text, ids, lps = self.add(outs)
        last = outs[-1]
        finish = last.finish_reason.value if last.finished and last.finish_reason else None
        calls: list[dict] = []
        if self.tool_stream is not None:
            text = self.tool_stream.feed(text)
            if finish:
                rest, calls = self.tool_stream.finish()
                text += rest or ""
                finish = "tool_calls" if calls else finish
        logprobs = self._render_logprobs(lps) if lps else None
        if logprobs is not None:
            self.offset += sum(len(t) for t in logprobs.get("tokens", []))
        if self.echo:
            text, self.echo = self.echo + text, ""
            logprobs = self._with_prompt(logprobs)
        token_ids = ids if self.greq.return_token_ids else None
        if not (text or finish or token_ids or logprobs):
            return None
        if calls or logprobs is not None:
            return responses.sse(responses.stream_chunk(
                self.greq.kind, self.active.ctx.request_id, self.greq.model, self.created, text, finish, token_ids,
                include_usage=self.greq.include_usage, index=self.index, logprobs=logprobs, tool_calls=calls))
        return self.encoder.encode(text, finish, ids)

    # ---- whole response -------------------------------------------------------------------------
    def body(self, index: int | None = None) -> dict:
        """This choice in a non-streamed response (at `index`, which best_of renumbers)."""
        text = self.echo + "".join(self.text)
        finish = self.active.finish_reason
        logprobs = None
        if self.want_logprobs:
            logprobs = (responses.chat_logprobs(self.logprobs, self.token_text) if self.greq.kind == "chat"
                        else self._with_prompt(responses.completion_logprobs(self.logprobs, self.token_text,
                                                                             len(self.echo))))
        out: dict = {"index": self.index if index is None else index}
        if self.greq.kind == "chat":
            content, calls = (tools.parse(text, self.greq.tools, self.greq.parallel_tool_calls)
                              if self.tool_stream is not None else (text, []))
            message: dict = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls"
            out["message"] = message
        else:
            out["text"] = text
        out["logprobs"] = logprobs
        out["finish_reason"] = finish
        if self.greq.return_token_ids:
            out["token_ids"] = self.token_ids
        return out
