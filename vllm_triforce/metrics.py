"""`vllm:triforce_*` Prometheus counters, from the worker to whichever process serves metrics.

The counters are kept by the proposer inside vLLM's worker, which is often not the process
that answers `/metrics` or `LLM.get_metrics()` (engine core and workers are separate
processes by default; Ray actors may be on other hosts' processes). vLLM 0.32 has no channel
from a worker's proposer to the front end's stat loggers, so:

- the worker (TP rank 0 only: all ranks take identical decisions) writes its counters as a
  small JSON file into a directory (atomic rename), through a `Publisher` whose own thread
  writes: at once after a step that saw a request come or go; after any other step at
  most every PUBLISH_INTERVAL_S seconds, the latest within that time; and, in the caller's
  thread, at once before a scrape in the same process (`LLM.get_metrics()` offline). A
  step never waits for a file write;
- the directory is created by the first process that loads the plugin (the front end, which
  starts engine core and workers afterwards) and passed down in `VLLM_TRIFORCE_METRICS_DIR`
  (vLLM forwards `VLLM_*` variables to its workers, Ray actors included);
- a Prometheus collector registered in every process that loads the plugin sums the files on
  scrape, so `/metrics` and `LLM.get_metrics()` show them beside `vllm:spec_decode_*`;
- gauges count only while their engine lives: a freed proposer rewrites its file with gauges
  at 0, and files of workers no longer running are ignored for gauges.
Counters are cumulative over every engine started from the same front-end process.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path

ENV_DIR = "VLLM_TRIFORCE_METRICS_DIR"
PREFIX = "vllm:triforce_"
COUNTERS = {
    "middle_proposed": "Tokens the small draft proposed to the target over its retrieval cache",
    "middle_accepted": "Of those, tokens the retrieval-cache target accepted",
    "middle_rounds": "Batched middle-level (retrieval-cache) target passes",
    "refreshes": "Per-request re-selections of retrieval blocks",
    "draft_rebases": "StreamingLLM position re-bases of the small draft",
    "summarised_blocks": "Full KV blocks whose summaries were set from the KV cache (lazily)",
    "top_proposed": "Middle-level tokens verified by the target over its full cache",
    "top_accepted": "Of those, tokens accepted by the full-cache verification",
    "plain_steps": "Steps in which the depth controller handed vLLM no draft at all",
    "drafting_steps": "Steps in which at least one request was handed drafts",
}
GAUGES = {
    "live_requests": "Requests holding TriForce per-request state (freed with the request)",
    "predicted_tokens_per_s": "Depth controller: predicted tokens/s of its plans (decayed mean)",
    "achieved_tokens_per_s": "Depth controller: achieved tokens/s of decode steps (decayed)",
}
# Histogram: the depth (tokens handed to vLLM) chosen per decoding request and step.
HISTOGRAM = ("depth_counts", "chosen_depth",
             "Tokens handed to vLLM per decoding request and step (0: a plain decode step)")
_registered = False
PUBLISH_INTERVAL_S = 0.5
_publishers: weakref.WeakSet = weakref.WeakSet()  # this process's, flushed before a scrape


def metrics_dir() -> Path:
    """The shared directory, created (and removed at exit) by the first process to ask."""
    path = os.environ.get(ENV_DIR)
    if path is None:
        path = tempfile.mkdtemp(prefix="vllm-triforce-metrics-")
        os.environ[ENV_DIR] = path
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def write_snapshot(source_id: str, snapshot: dict[str, int]) -> None:
    """Called by the worker: publish this engine's cumulative counters."""
    directory = metrics_dir()
    tmp = directory / f".{source_id}.tmp"
    tmp.write_text(json.dumps({k: snapshot[k] for k in (*COUNTERS, *GAUGES, HISTOGRAM[0])}))
    os.replace(tmp, directory / f"{source_id}.json")


class Publisher:
    """Publishes one source's counters (`snapshot()`, a callable) from a thread of its own,
    so that no step waits for a file: a step's `publish()` only marks the counters pending
    and wakes the thread, which writes them once the last write is `interval` seconds old
    (the file is never more than `interval` behind the counters), or at once for
    `publish(at_once=True)` (a request came or went). `flush()` writes now, in the caller's
    thread, if anything is pending (before a scrape); `close()` stops it (the engine is
    gone), after any write under way."""

    def __init__(self, source_id: str, snapshot, interval: float = PUBLISH_INTERVAL_S):
        self.source_id = source_id
        self.snapshot = snapshot
        self.interval = interval
        self._last = float("-inf")
        self._pending = False
        self._urgent = False
        self._closed = False
        self._lock = threading.Lock()  # the flags above
        self._wake = threading.Condition(self._lock)
        self._write_lock = threading.Lock()  # one write at a time, none after `close`
        self._thread: threading.Thread | None = None
        _publishers.add(self)

    def publish(self, at_once: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            # the thread is woken only when this changes what it waits for: nothing was
            # pending (it sleeps until told), or the write became urgent; otherwise it
            # already sleeps until the pending write is due
            wake = not self._pending or (at_once and not self._urgent)
            self._pending = True
            self._urgent = self._urgent or at_once
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"triforce-metrics-{self.source_id}")
                self._thread.start()
            elif wake:
                self._wake.notify()

    def _run(self) -> None:
        """The thread: wait until something pending is due, take it, write it."""
        while True:
            with self._lock:
                while not self._closed and not self._take_due():
                    self._wake.wait(self._until_due())
                if self._closed:
                    return
                self._write_lock.acquire()  # taken with it: a flush waits for this write
            self._write()

    def _take_due(self) -> bool:
        """(the lock held) Whether a write is due now; if so it is no longer pending."""
        if not self._pending or (not self._urgent
                                 and time.monotonic() < self._last + self.interval):
            return False
        self._pending = self._urgent = False
        self._last = time.monotonic()
        return True

    def _until_due(self) -> float | None:
        """(the lock held) Seconds until the pending write is due (None: none is pending)."""
        if not self._pending:
            return None
        return max(self._last + self.interval - time.monotonic(), 0.0)

    def _write(self) -> None:
        """(the write lock taken) Write the counters, unless closed; let the lock go."""
        try:
            if not self._closed:
                write_snapshot(self.source_id, self.snapshot())
        finally:
            self._write_lock.release()

    def flush(self) -> None:
        with self._lock:
            if self._closed:
                return
            take = self._pending
            self._pending = self._urgent = False
            if take:
                self._last = time.monotonic()
            self._write_lock.acquire()  # after the thread's write under way, if any
        if take:
            self._write()
        else:
            self._write_lock.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        with self._write_lock:  # a write under way ends before the engine's last one
            pass


def retire(publisher: Publisher) -> None:
    """The engine's proposer went away: no more writes, and its gauges drop to 0."""
    publisher.close()
    retire_snapshot(publisher.source_id, publisher.snapshot)


def retire_snapshot(source_id: str, snapshot) -> None:
    """Called when an engine's proposer goes away: its gauges drop to 0, its counters stay.

    `snapshot` is a callable returning the final counters. Only a source that published
    before is rewritten (other TP ranks never publish), and a directory already removed at
    exit is not re-created.
    """
    path = os.environ.get(ENV_DIR)
    if path is None or not (Path(path) / f"{source_id}.json").exists():
        return
    try:
        write_snapshot(source_id, {**snapshot(), **dict.fromkeys(GAUGES, 0)})
    except OSError:
        pass


def read_totals() -> dict:
    for publisher in list(_publishers):  # an engine in this process: its latest counters
        publisher.flush()
    totals = {**dict.fromkeys((*COUNTERS, *GAUGES), 0), HISTOGRAM[0]: []}
    path = os.environ.get(ENV_DIR)
    if path is None or not os.path.isdir(path):
        return totals
    for file in Path(path).glob("*.json"):
        try:
            values = json.loads(file.read_text())
        except (OSError, ValueError):  # being replaced right now: next scrape has it
            continue
        alive = _alive(file.name.split("-", 1)[0])
        for name in (*COUNTERS, *GAUGES):
            if name in COUNTERS or alive:  # a dead worker's gauge is no longer current
                totals[name] += values.get(name, 0)
        totals[HISTOGRAM[0]] = _add_lists(totals[HISTOGRAM[0]], values.get(HISTOGRAM[0], []))
    return totals


def _add_lists(a: list, b: list) -> list:
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0)
            for i in range(max(len(a), len(b)))]


def _alive(pid: str) -> bool:
    """Whether the worker that wrote a file (named PID-...) still runs on this host."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class TriForceCollector:
    """Prometheus collector: one counter family per TriForce counter."""

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)

        totals = read_totals()
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=totals[name])
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=totals[name])
        counts = totals[HISTOGRAM[0]]
        cumulative = [sum(counts[:k + 1]) for k in range(len(counts))]
        buckets = [(str(k), c) for k, c in enumerate(cumulative)] + [("+Inf", sum(counts))]
        yield HistogramMetricFamily(PREFIX + HISTOGRAM[1], HISTOGRAM[2], buckets=buckets,
                                    sum_value=sum(k * c for k, c in enumerate(counts)))


def register_collector() -> None:
    """Register the collector in this process's default registry, once."""
    global _registered
    if _registered:
        return
    import prometheus_client

    metrics_dir()
    prometheus_client.REGISTRY.register(TriForceCollector())
    _registered = True
