"""Regenerate the console screenshots in this directory from the recorded daemon stream.

    .venv/bin/python docs/console/screenshots.py

Each screen of `gpuserv top --replay tests/console_fixtures/stream.ndjson`, as
SVG from Textual's save_screenshot (the same recording the snapshot tests use).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from console.app import ConsoleApp

HERE = Path(__file__).resolve().parent
STREAM = HERE.parent.parent / "tests" / "console_fixtures" / "stream.ndjson"
SHOTS = [("dashboard-160x48", (160, 48), []), ("dashboard", (80, 24), []), ("requests", (80, 24), ["2"]),
         ("models", (80, 24), ["3"]), ("partitions", (80, 24), ["4"]), ("events", (100, 24), ["5"]),
         ("help", (80, 24), ["question_mark"])]


async def shoot(name: str, size: tuple[int, int], keys: list[str]) -> None:
    app = ConsoleApp.replay(STREAM)
    async with app.run_test(size=size) as pilot:
        await app.workers.wait_for_complete()
        app.tick()
        await pilot.pause()
        for key in keys:
            await pilot.press(key)
            await pilot.pause()
        app.save_screenshot(f"{name}.svg", path=str(HERE))


def main() -> None:
    for name, size, keys in SHOTS:
        asyncio.run(shoot(name, size, keys))
        print(HERE / f"{name}.svg")


if __name__ == "__main__":
    main()
