"""How busy the vLLM servers were between two weight syncs (``vllm_busy_fraction``).

A thread reads every server's Prometheus ``/metrics`` every ``interval_s`` and notes
whether any request was running (``vllm:num_requests_running`` > 0). A thread, not an
asyncio task: the trainer's forward/backward holds its event loop for seconds at a time.
:meth:`BusySampler.take` gives the share of samples since the previous call in which the
server was busy, per server averaged over the servers that answered, and starts over. A
sample belongs to the window in which it was taken: one whose request was still under way
when ``take`` closed its window is dropped, not counted in the next (on a loaded machine a
``/metrics`` read can take longer than a window: a read begun while the rollouts ran would
otherwise report them busy after they had ended).
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

from environments.settings import bearer_headers, run_token

METRIC = "vllm:num_requests_running"


def running_requests(url: str, timeout_s: float = 2.0) -> float | None:
    """The requests ``url`` is running now (None: it did not answer, or does not say)."""
    request = urllib.request.Request(url + "/metrics", headers=bearer_headers(run_token()))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError):
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(METRIC)]
    return sum(values) if values else None


class BusySampler:
    def __init__(self, urls: list[str], interval_s: float = 0.25):
        self.urls = [u.rstrip("/") for u in urls]
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.counts = {u: [0, 0] for u in self.urls}  # url: [busy samples, samples]
        self.window = 0  # how many times take() has closed a window
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="vllm-busy", daemon=True)

    def start(self) -> BusySampler:
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval_s):
            for url in self.urls:
                with self.lock:
                    window = self.window
                running = running_requests(url)
                if running is None:
                    continue
                with self.lock:
                    if window != self.window:  # taken across a take(): neither window's
                        continue
                    self.counts[url][0] += running > 0
                    self.counts[url][1] += 1

    def take(self) -> float | None:
        """The busy share since the last call (None: no sample)."""
        with self.lock:
            shares = [busy / n for busy, n in self.counts.values() if n]
            self.counts = {u: [0, 0] for u in self.urls}
            self.window += 1
        return sum(shares) / len(shares) if shares else None

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
