"""`pytest --compile-stats`: where the suite's time goes. XLA compilations are most of it (the tiny
models run in microseconds), so each test's wall time is shown beside the compilations it made
and their seconds, counted from JAX's own monitoring events (a program loaded from the session's
compilation cache counts as one, with the seconds it took to load). The summary lists the test
files by wall time, then the tests that compiled most; under pytest-xdist each worker counts its
own tests and the controller adds them up. Compilations in subprocesses (the command-line
tests) are not seen: their time shows as wall time only."""

from __future__ import annotations

import collections
import time

import pytest

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileStats:
    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}  # test id -> [wall s, compilations, compile s]
        self._n, self._s = 0, 0.0
        self._listening = False

    def _listen(self) -> None:
        """Registered at the first test, so that the xdist controller never imports jax."""
        import jax.monitoring

        self._listening = True

        def on_duration(event: str, duration: float, **_) -> None:
            if event == COMPILE_EVENT:
                self._n += 1
                self._s += duration

        jax.monitoring.register_event_duration_secs_listener(on_duration)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if not self._listening:
            self._listen()
        self._n, self._s = 0, 0.0
        t0 = time.perf_counter()
        yield
        self.rows[item.nodeid] = [time.perf_counter() - t0, self._n, self._s]

    def pytest_sessionfinish(self, session):
        out = getattr(session.config, "workeroutput", None)
        if out is not None:  # an xdist worker: its rows go back to the controller
            out["eagle3_compile_stats"] = self.rows

    def pytest_testnodedown(self, node, error):
        self.rows.update(getattr(node, "workeroutput", {}).get("eagle3_compile_stats", {}))

    def pytest_terminal_summary(self, terminalreporter):
        if not self.rows:
            return
        files: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
        for nodeid, (wall, n, s) in self.rows.items():
            f = files[nodeid.split("::")[0]]
            f[0] += 1
            f[1] += wall
            f[2] += n
            f[3] += s
        w = terminalreporter.write_line
        total = [sum(f[i] for f in files.values()) for i in range(4)]
        w("")
        w(f"compile stats: {total[0]:.0f} tests, {total[1]:.0f} s in tests (all workers), "
          f"{total[2]:.0f} compilations, {total[3]:.0f} s compiling")  # fmt: skip
        w(f"{'file':<44} {'tests':>5} {'wall s':>7} {'compiles':>8} {'compile s':>9}")
        for name, (k, wall, n, s) in sorted(files.items(), key=lambda kv: -kv[1][1])[:20]:
            w(f"{name:<44} {k:>5} {wall:>7.1f} {n:>8.0f} {s:>9.1f}")
        w(f"{'test (most compilations)':<66} {'wall s':>7} {'compiles':>8} {'compile s':>9}")
        for nodeid, (wall, n, s) in sorted(self.rows.items(), key=lambda kv: -kv[1][1])[:10]:
            name = nodeid.removeprefix("tests/")
            name = name if len(name) <= 66 else name[:63] + "..."
            w(f"{name:<66} {wall:>7.1f} {n:>8.0f} {s:>9.1f}")
