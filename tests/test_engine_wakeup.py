"""engine/wakeup.py: calls posted from another thread run on the event loop, in order, each once; what is
still queued when the poster closes runs before the eventfd goes; a loop without readers gets
call_soon_threadsafe."""

from __future__ import annotations

import asyncio
import threading

from gpuservd.engine.wakeup import Wakeup


def test_posts_from_a_thread_run_on_the_loop_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        wake = Wakeup(loop)
        assert wake._fd is not None  # the eventfd path, not the fallback
        got: list[tuple[int, bool]] = []
        done = asyncio.Event()

        def on_loop(i):
            got.append((i, threading.current_thread() is threading.main_thread()))
            if i == 999:
                done.set()

        def poster():
            for i in range(1000):
                wake.post(on_loop, i)

        t = threading.Thread(target=poster)
        t.start()
        await asyncio.wait_for(done.wait(), 10)
        t.join()
        assert got == [(i, True) for i in range(1000)]
        wake.post(on_loop, 1000)  # queued, not yet run: close() runs it before the eventfd goes
        fd = wake._fd
        wake.close()
        await asyncio.sleep(0.05)
        assert got[-1] == (1000, True)
        assert wake._fd is None
        try:
            import os
            os.fstat(fd)
            closed = False
        except OSError:
            closed = True
        assert closed

    asyncio.run(main())


def test_a_failing_call_is_reported_and_the_rest_still_run():
    async def main():
        loop = asyncio.get_running_loop()
        errors = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx["exception"]))
        wake = Wakeup(loop)
        got = []

        def boom():
            raise ValueError("x")

        threading.Thread(target=lambda: (wake.post(boom), wake.post(got.append, 1))).start()
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        assert got == [1] and isinstance(errors[0], ValueError)
        wake.close()
        await asyncio.sleep(0)

    asyncio.run(main())


def test_a_loop_without_readers_gets_call_soon_threadsafe():
    class Poster:
        def __init__(self):
            self.calls = []

        def call_soon_threadsafe(self, fn, *args):
            self.calls.append((fn, args))

    p = Poster()
    wake = Wakeup(p)
    wake.post(print, 1, 2)
    assert p.calls == [(print, (1, 2))]
    wake.close()  # nothing to close
