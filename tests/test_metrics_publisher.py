"""metrics.Publisher: the worker's counters reach the metrics directory at most every
`interval` seconds, never later than that after a step, at once before an in-process scrape,
and never after the engine is retired (a file written every step would cost ~0.3 ms of it)."""

import json
import time

from vllm_triforce import metrics


def counters(value):
    return dict.fromkeys((*metrics.COUNTERS, *metrics.GAUGES), value) | {"depth_counts": [value]}


def published(source):
    return json.loads((metrics.metrics_dir() / f"{source}.json").read_text())


def test_publisher_throttles_and_catches_up():
    state = {"n": 1}
    publisher = metrics.Publisher("9999999-throttle", lambda: counters(state["n"]), interval=0.3)
    try:
        publisher.publish()  # the first write is immediate
        assert published(publisher.source_id)["top_proposed"] == 1
        state["n"] = 2
        publisher.publish()  # within the interval: left to the timer
        assert published(publisher.source_id)["top_proposed"] == 1
        time.sleep(0.6)  # the timer wrote the latest counters
        assert published(publisher.source_id)["top_proposed"] == 2
        state["n"] = 3
        publisher.publish()
        assert metrics.read_totals()["top_proposed"] >= 3  # a scrape flushes this process's
        assert published(publisher.source_id)["top_proposed"] == 3
        state["n"] = 5
        publisher.publish(at_once=True)  # a request came or went: written within the interval
        assert published(publisher.source_id)["top_proposed"] == 5
    finally:
        metrics.retire(publisher)
    assert published(publisher.source_id)["live_requests"] == 0  # gauges retired
    state["n"] = 4
    publisher.publish()
    time.sleep(0.5)
    assert published(publisher.source_id)["top_proposed"] == 5  # closed: nothing more
    (metrics.metrics_dir() / f"{publisher.source_id}.json").unlink()
