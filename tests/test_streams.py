"""`CommStream.keep_for`: a tensor handed from one thread's stream to another's is recorded on the
receiving stream, so the caching allocator cannot reuse its memory under that stream's work."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lightning_prague.core.comm.streams import CommStream


def test_tensors_on_cuda_are_recorded_on_the_using_threads_stream_and_others_are_left_alone(monkeypatch):
    used_stream = object()  # stands for the calling thread's current CUDA stream
    recorded: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: used_stream)

    def cuda_tensor(name: str) -> SimpleNamespace:
        return SimpleNamespace(is_cuda=True, device="cuda:0", record_stream=lambda s: recorded.append((name, s)))

    CommStream.keep_for([cuda_tensor("snapshot"), torch.zeros(3), cuda_tensor("delta")])
    assert recorded == [("snapshot", used_stream), ("delta", used_stream)]


def test_on_the_cpu_nothing_is_recorded():
    stream = CommStream(torch.device("cpu"))
    assert stream.stream is None and stream.mark() is None
    CommStream.keep_for([torch.ones(2), torch.ones(2, dtype=torch.float64)])  # no CUDA call is made
