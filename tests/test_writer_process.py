"""The capture writer process: what it writes equals an in-process CaptureWriter's files,
bytes of every dtype survive the pipe, the queue is bounded, errors and a dead child
surface as RuntimeErrors naming the pass, the file or the exit code."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from accuracy import in_vllm
from accuracy.tensor_io import read as read_captures
from accuracy.tensor_io import tensor_bytes, tensor_from_bytes
from accuracy.writer import CaptureWriter
from accuracy.writer_process import WriterProcess

H, V = 8, 16

TENSORS = {  # name -> a tensor of an awkward kind
    "model.layers.0": torch.randn(2, 3, H),
    "model.layers.1": torch.randn(2, 3, H, dtype=torch.bfloat16),
    "model.layers.2.mlp": torch.randn(H, 3).t(),  # not contiguous
    "model.norm": torch.randn(3, H, dtype=torch.float16),
    "lm_head": torch.randn(3, V, dtype=torch.float64),
    "ids": torch.arange(3, dtype=torch.int64),
    "mask": torch.tensor([True, False, True]),
    "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
    "empty": torch.zeros(0, H),
}


def _pass_args(step: int) -> dict:
    return dict(
        req_ids=["r0", "r1"],
        positions=[step, step + 1, 7],
        is_prefill=step == 0,
        padding_mask=[False, False, True],
        token_ids=[5, 6, 0],
        extra={"engine": "vllm", "num_scheduled_tokens": [2, 1], "ids": [1, 2]},
    )


@pytest.fixture
def writers(tmp_path):
    started = []

    def make(root, **kw) -> tuple[CaptureWriter, WriterProcess]:
        w = CaptureWriter(str(root), config={"model": "tiny"})
        wp = WriterProcess(w.settings(), **kw)
        started.append(wp)
        return w, wp

    yield make
    for wp in started:
        if wp._proc.poll() is None:
            wp._proc.kill()
            wp._proc.wait()


@pytest.mark.parametrize("name", list(TENSORS))
def test_tensor_bytes_round_trip_bitwise(name):
    t = TENSORS[name]
    back = tensor_from_bytes(tensor_bytes(t), str(t.dtype).replace("torch.", ""), list(t.shape))
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_unknown_dtype_in_a_frame_is_a_value_error():
    with pytest.raises(ValueError, match="unknown dtype 'complex32'"):
        tensor_from_bytes(memoryview(b"\0" * 4), "complex32", [1])


def test_child_writes_what_an_in_process_writer_writes(tmp_path, writers):
    mine = CaptureWriter(str(tmp_path / "a"), config={"model": "tiny"})
    mine.enable()
    _, wp = writers(tmp_path / "b")
    names, caps = list(TENSORS), list(TENSORS.values())
    for step in range(3):
        mine.write(caps, names, **_pass_args(step))
        wp.submit(f"pass {step}", caps, names, **_pass_args(step))
    wp.close()
    assert wp._proc.returncode == 0
    a, b = read_captures(str(tmp_path / "a" / "dp0")), read_captures(str(tmp_path / "b" / "dp0"))
    assert (
        [p.dir_name for p in b]
        == [p.dir_name for p in a]
        == [
            "prefill_s3_0",
            "decode_b3_0",
            "decode_b3_1",
        ]
    )
    for pa, pb in zip(a, b, strict=True):
        assert pb.metadata.to_dict() == pa.metadata.to_dict()
        for n in names:
            ta, tb = pa.tensors[n][0], pb.tensors[n][0]
            assert tb.dtype == ta.dtype and torch.equal(tb, ta), n
    ma, mb = (json.load(open(tmp_path / d / "manifest.json")) for d in ("a", "b"))
    ma.pop("created"), mb.pop("created")
    # both record the checkout's revision (or both none outside git); compared apart, as a
    # commit landing between the two writers changes it
    assert (ma.pop("git_revision") is None) == (mb.pop("git_revision") is None)
    assert mb == ma


def test_a_full_queue_blocks_submit_until_the_child_catches_up(tmp_path, writers):
    _, wp = writers(tmp_path, max_pending=2)
    wp.flush()  # the child is up
    os.kill(wp._proc.pid, signal.SIGSTOP)  # the disk stalls
    done = []

    def forward():
        for step in range(5):
            wp.submit(f"pass {step}", [torch.full((2, 1, H), float(step))], ["model.layers.0"],
                      req_ids=["r0"], positions=[step], is_prefill=False)  # fmt: skip
            done.append(step)

    th = threading.Thread(target=forward)
    th.start()
    time.sleep(1.0)
    try:
        assert done == [0, 1]  # two in flight, the third waits
        assert th.is_alive()
    finally:
        os.kill(wp._proc.pid, signal.SIGCONT)
    th.join(timeout=30)
    assert done == [0, 1, 2, 3, 4]
    wp.flush()
    passes = read_captures(str(tmp_path / "dp0"))
    assert [p.metadata.positions for p in passes] == [[i] for i in range(5)]
    for i, p in enumerate(passes):
        assert torch.equal(p.tensors["model.layers.0"][0], torch.full((2, 1, H), float(i)))


def test_held_passes_are_copied_and_reach_the_child_only_when_released(tmp_path, writers):
    _, wp = writers(tmp_path, hold=True)
    wp.flush()  # the child is up
    buf = torch.zeros(2, 1, H)  # one buffer the "forward" reuses every step
    for step in range(3):
        buf.fill_(float(step))
        wp.submit(f"pass {step}", [buf], ["model.layers.0"],
                  req_ids=["r0"], positions=[step], is_prefill=False)  # fmt: skip
    time.sleep(0.5)
    assert not (tmp_path / "dp0").exists()  # held: nothing was sent
    wp.release()
    buf.fill_(-1.0)  # the next step overwrites the buffer
    wp.flush()
    passes = read_captures(str(tmp_path / "dp0"))
    assert [p.metadata.positions for p in passes] == [[0], [1], [2]]
    for i, p in enumerate(passes):
        assert torch.equal(p.tensors["model.layers.0"][0], torch.full((2, 1, H), float(i)))


def test_a_full_hold_is_released_by_submit_and_flush_sends_the_rest(tmp_path, writers):
    _, wp = writers(tmp_path, max_pending=2, hold=True)
    for step in range(5):  # never released by the caller
        wp.submit(f"pass {step}", [torch.full((2, 1, H), float(step))], ["model.layers.0"],
                  req_ids=["r0"], positions=[step], is_prefill=False)  # fmt: skip
        assert len(wp._held) + wp._pending <= 2
    wp.flush()
    passes = read_captures(str(tmp_path / "dp0"))
    assert [p.metadata.positions for p in passes] == [[i] for i in range(5)]


def _one(wp, step):
    ts = [torch.full((2, 1, H), float(step)), torch.full((1, V), float(-step))]
    wp.submit(f"pass {step}", ts, ["model.layers.0", "lm_head"],
              req_ids=["r0"], positions=[step], is_prefill=False)  # fmt: skip


def test_a_failed_pass_is_raised_by_flush_naming_pass_and_file(tmp_path, writers):
    _, wp = writers(tmp_path)
    _one(wp, 0)
    wp.flush()
    # a file where the next pass's module directory must go: that write fails
    blocker = tmp_path / "dp0" / "decode_b1_1" / "lm_head"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")
    os.kill(wp._proc.pid, signal.SIGSTOP)  # both passes are queued before either is written
    _one(wp, 1)
    _one(wp, 2)  # after a failed pass: not written, so no pass after a gap lands
    os.kill(wp._proc.pid, signal.SIGCONT)
    with pytest.raises(RuntimeError, match=r"writing pass 1 failed.*lm_head/rank0\.safetensors"):
        wp.flush()
    wp.flush()  # reported once, then the writer goes on
    blocker.unlink()
    _one(wp, 3)
    wp.flush()
    assert sorted(os.listdir(tmp_path / "dp0")) == ["decode_b1_0", "decode_b1_1"]
    assert read_captures(str(tmp_path / "dp0"))[1].metadata.positions == [3]


def test_a_failed_pass_is_raised_by_the_next_submit(tmp_path, writers):
    _, wp = writers(tmp_path)
    (tmp_path / "dp0").mkdir()
    (tmp_path / "dp0" / "decode_b1_0").write_text("a file where the pass's directory goes")
    _one(wp, 0)
    wp._drain(block=True)  # its acknowledgement is back
    with pytest.raises(RuntimeError, match=r"writing pass 0 failed.*decode_b1_0"):
        _one(wp, 1)


def test_a_dead_child_is_an_error_naming_its_exit_code(tmp_path, writers):
    _, wp = writers(tmp_path)
    _one(wp, 0)
    wp._proc.kill()
    wp._proc.wait()
    with pytest.raises(RuntimeError, match=r"writer process exited \(code -9\)"):
        wp.flush()


def test_metadata_that_is_not_json_is_refused_before_anything_is_sent(tmp_path, writers):
    _, wp = writers(tmp_path)
    with pytest.raises(TypeError, match="object is not JSON-serialisable"):
        wp.submit("pass 0", [torch.zeros(1)], ["x"], ["r0"], [0], False, extra={"bad": object()})
    ts = [torch.zeros(2, 1, H)]
    wp.submit("pass 0", ts, ["model.layers.0"], ["r0"], [0], False,
              extra={"ids": torch.tensor([1, 2])})  # fmt: skip
    wp.flush()
    (p,) = read_captures(str(tmp_path / "dp0"))
    assert p.dir_name == "decode_b1_0" and p.metadata.extra["ids"] == [1, 2]


def test_mismatched_names_and_bad_max_pending_are_value_errors(tmp_path, writers):
    with pytest.raises(ValueError, match="max_pending"):
        WriterProcess({"capture_dir": str(tmp_path)}, max_pending=0)
    _, wp = writers(tmp_path)
    with pytest.raises(ValueError, match="2 captures but 1 names"):
        wp.submit("pass 0", [torch.zeros(1), torch.zeros(1)], ["x"], ["r0"], [0], False)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least two CPUs")
def test_the_child_runs_on_the_cpus_this_process_is_not_bound_to(tmp_path, writers):
    mine = os.sched_getaffinity(0)
    forward_cpu = min(mine)
    os.sched_setaffinity(0, {forward_cpu})  # as vLLM's CPU worker binds its forward
    try:
        _, wp = writers(tmp_path)
        wp.flush()  # the child has set its affinity before its first acknowledgement
        child = os.sched_getaffinity(wp._proc.pid)
    finally:
        os.sched_setaffinity(0, mine)
    assert forward_cpu not in child and child


def test_flush_captures_flushes_every_registered_writer(tmp_path, writers):
    _, wp = writers(tmp_path, max_pending=8)
    in_vllm._WRITERS.add(wp)
    for step in range(6):
        _one(wp, step)
    in_vllm.flush_captures()
    assert len(os.listdir(tmp_path / "dp0")) == 6


def test_a_model_capture_with_a_writer_process_writes_its_in_process_files(tmp_path, writers):
    from accuracy import ModelCapture

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, V))
    caps = {d: ModelCapture(model, ["0", "2"], str(tmp_path / d), subdirectory="draft")
            for d in ("a", "b")}  # fmt: skip
    caps["b"].writes = WriterProcess(caps["b"].writer.settings())
    x = torch.randn(3, H)
    for c in caps.values():
        c.enable()
        for step in range(2):
            c.setup_tensor_capture()
            model(x + step)
            got = c.save_tensor_captures(torch.tensor([[4, 5, 6]]), step == 0, req_ids=["r0"])
            assert (got is None) == (c is caps["b"])
    caps["b"].writes.close()
    a, b = (read_captures(str(tmp_path / d / "draft" / "dp0")) for d in ("a", "b"))
    assert [p.dir_name for p in b] == [p.dir_name for p in a] == ["prefill_s3_0", "decode_b3_0"]
    for pa, pb in zip(a, b, strict=True):
        assert pb.metadata.to_dict() == pa.metadata.to_dict()
        for n in ("0", "2"):
            assert torch.equal(pb.tensors[n][0], pa.tensors[n][0])
