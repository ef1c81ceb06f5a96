"""Modal dialogs: a yes/no confirmation, a one-line prompt, and the help page."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

HELP = """\
gpuserv top: the daemon, live, over its Unix socket

1 Dashboard   step latency per model (P50/P99, chart), tokens/s,
              queues, KV use, preemptions, swap, device, hints
2 Requests    / filter, s sort column, S reverse order,
              c cancel the selected request (asks first)
3 Models      l load, u unload, p pin/unpin (each asks first)
4 Partitions  SM groups, quotas, arbiter shares
5 Events      f next kind filter, End follows the newest

? help   q quit   arrows, PgUp/PgDn move   Esc closes a dialog

Data this daemon does not report shows "not reported by this
daemon"; nothing is estimated. Redraws at most 4 times a second.
Times are UTC. When the daemon goes away the top line says so,
and the console reconnects by itself.
"""


class ConfirmScreen(ModalScreen[bool]):
    """`y` / Enter confirms, `n` / Esc declines."""

    BINDINGS = [Binding("y,enter", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, markup=False)
            yield Static("y / Enter: yes     n / Esc: no", classes="dialog-keys")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class PromptScreen(ModalScreen[str | None]):
    """A one-line answer (Enter), or None (Esc)."""

    BINDINGS = [Binding("escape", "close", "Cancel")]

    def __init__(self, question: str, placeholder: str = ""):
        super().__init__()
        self.question = question
        self.placeholder = placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, markup=False)
            yield Input(placeholder=self.placeholder)
            yield Static("Enter: go     Esc: cancel", classes="dialog-keys")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_close(self) -> None:
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Static(HELP, markup=False)
            yield Static("Esc / ?: close", classes="dialog-keys")

    def action_close(self) -> None:
        self.dismiss(None)
