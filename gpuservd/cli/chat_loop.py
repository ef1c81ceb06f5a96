"""The terminal chat loop shared by `gpuserv chat` (through the daemon) and `--local`."""

from __future__ import annotations

import sys
from typing import Callable, Iterable, Optional

import typer

from gpuservd.errors import UserError


def chat_loop(model: str, system: Optional[str], reply_stream: Callable[[list[dict]], Iterable[str]]) -> None:
    """Read lines, stream each reply from reply_stream(history); /reset clears, Ctrl-D quits.

    Ctrl-C during a reply stops that reply only (closing the stream aborts the request).
    """
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            typer.echo("", err=True)
            return
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = []
        try:
            sys.stdout.write(f"{model}> ")
            for text in reply_stream(history):
                sys.stdout.write(text)
                sys.stdout.flush()
                reply.append(text)
            sys.stdout.write("\n")
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]\n")
        except UserError as exc:  # e.g. the conversation outgrew the context
            typer.echo(f"error: {exc}", err=True)
            history.pop()
            continue
        history.append({"role": "assistant", "content": "".join(reply)})
