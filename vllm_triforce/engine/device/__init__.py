"""How a pass runs on the device: the levels say what to run, this package runs it.

- `transfer.py`: host values to the device in one copy, device values back in one.
- `forward.py`: a pass's inputs (`build_pass`), the only code that builds attention
  metadata, and `run_pass`, today's path (metadata per pass, any shape).
- `capture.py`: each target layer's query and keys as its attention receives them, kept
  as copies, by reference, or in persistent buffers (`CaptureBuffers`).
- `round_graph.py`: the middle level's passes over persistent buffers, one pass shape per
  token bucket with its metadata built once, captured as a CUDA graph on a GPU and
  replayed eagerly over the same buffers on a CPU (`RoundGraphs`); `ReplayGuard` holds a
  replay to what was captured.
"""
