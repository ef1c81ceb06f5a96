"""The console's screens; each is thin: it reads the ConsoleState and hands actions to the feed."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer

from console.widgets import StatusBar


class ConsoleScreen(Screen):
    """Status bar on top, the screen's body, the keys in the footer; `redraw()` is driven by the app's tick."""

    NAME = ""

    def compose(self) -> ComposeResult:
        yield StatusBar(self.NAME)
        yield from self.body()
        yield Footer()

    def body(self) -> ComposeResult:
        raise NotImplementedError

    def on_screen_resume(self) -> None:
        self.redraw()

    def on_resize(self) -> None:
        self.call_after_refresh(self.redraw)

    def redraw(self) -> None:
        if not self.is_mounted:
            return
        state = self.app.state
        self.query_one(StatusBar).show(state)
        self.draw(state)

    def draw(self, state) -> None:
        raise NotImplementedError
