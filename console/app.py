"""`gpuserv top`: the Textual app. It owns a ConsoleState, a feed that fills it, and a redraw tick.

The feed (live socket or a recording) runs as a worker and only updates the
state; the screens are redrawn by a timer, at most `MAX_HZ` times a second and
only when the state changed, so the console stays light over a slow SSH link.
"""

from __future__ import annotations

from textual.app import App, ScreenStackError
from textual.binding import Binding
from textual.css.query import NoMatches

from gpuservd.errors import UserError

from console.feed import LINK_ERRORS, LiveFeed, ReadOnly, ReplayFeed
from console.screens import ConsoleScreen
from console.screens.dashboard import DashboardScreen
from console.screens.dialogs import HelpScreen
from console.screens.events import EventsScreen
from console.screens.models import ModelsScreen
from console.screens.partitions import PartitionsScreen
from console.screens.requests import RequestsScreen
from console.state import ConsoleState
from console.widgets import SCREENS

MAX_HZ = 4.0  # redraws a second at most
DEFAULT_HZ = 2.0


class ConsoleApp(App):
    CSS_PATH = "console.tcss"
    TITLE = "gpuserv top"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    MODES = {"dashboard": DashboardScreen, "requests": RequestsScreen, "models": ModelsScreen,
             "partitions": PartitionsScreen, "events": EventsScreen}
    BINDINGS = [Binding(key, f"show('{name}')", label, show=False) for key, name, label in SCREENS] + [
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, feed_factory, refresh_hz: float = DEFAULT_HZ, start: str = "dashboard"):
        """feed_factory(state) -> a feed (LiveFeed / ReplayFeed); see `live()` and `replay()`."""
        super().__init__()
        self.state = ConsoleState()
        self.feed = feed_factory(self.state)
        self.refresh_s = 1.0 / min(MAX_HZ, max(refresh_hz, 0.1))
        self.start = start
        self.num_redraws = 0
        self._drawn_version = -1

    @classmethod
    def live(cls, socket_path=None, **kwargs) -> "ConsoleApp":
        return cls(lambda state: LiveFeed(state, socket_path), **kwargs)

    @classmethod
    def replay(cls, path, **kwargs) -> "ConsoleApp":
        return cls(lambda state: ReplayFeed(state, path), **kwargs)

    def on_mount(self) -> None:
        self.state.connection.where = self.feed.where
        self.switch_mode(self.start)
        self.run_worker(self.feed.run(), name="feed", group="feed")
        self.set_interval(self.refresh_s, self.tick)

    def tick(self) -> None:
        """The only place that redraws on data: once per interval, when something changed."""
        try:
            screen = self.screen
        except ScreenStackError:  # the timer can fire while a mode switch or the shutdown empties the stack
            return
        if self.state.version == self._drawn_version or not isinstance(screen, ConsoleScreen):
            return
        try:
            screen.redraw()
        except NoMatches:  # its widgets are not mounted yet (or no longer): the next tick draws it
            return
        self._drawn_version = self.state.version
        self.num_redraws += 1

    def action_show(self, name: str) -> None:
        if self.current_mode != name:
            self.switch_mode(name)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def act(self, ok: str, fn, *args) -> None:
        """Run an admin action in the background; say how it went in a notification."""

        async def go() -> None:
            try:
                await fn(*args)
            except (UserError, ReadOnly) as exc:
                self.notify(str(exc), severity="error", timeout=8)
                return
            except LINK_ERRORS as exc:  # the daemon went away mid-action: say so, keep the console
                self.notify(f"lost the daemon during the action ({type(exc).__name__}: {exc})", severity="error",
                            timeout=8)
                return
            self.notify(ok)

        self.run_worker(go(), group="actions")
