"""A sharded stream shared out by speed (`lightning_prague.core.data.shard_queue`), against a real control
plane served from a thread: every sample once, a lost rank's shard read on from its reported position,
reads past a shard's end dropped, slots that keep each worker process on its shard. The real jobs
(Hugging Face `datasets`, worker processes, a straggler, a kill) are in `tests/test_streaming_job.py`."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest
from helpers import CREDENTIALS
from torch.utils.data import IterableDataset

from lightning_prague.core import ControlClient, ControlPlane, SessionConfig, make_policy
from lightning_prague.core.data.shard_queue import ShardQueueSampler, ShardRead, ShardReader
from lightning_prague.core.data.shard_sources import HuggingFaceSource, ProtocolSource, shard_source
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.plane.server import MessageServer

pytestmark = pytest.mark.timeout(60)


class Files:
    """Our protocol: `num_shards` shards of different lengths, each read from any position."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.num_shards = len(lengths)
        self.opened: list[tuple[int, int]] = []

    def iter_shard(self, shard: int, start: int) -> Iterator[tuple[int, int]]:
        self.opened.append((shard, start))
        return ((shard, i) for i in range(start, self.lengths[shard]))


@pytest.fixture()
def sessions():
    """Three ranks' sessions of one control plane (served from a thread)."""
    plane = ControlPlane()
    server = MessageServer(plane.handle, "127.0.0.1", CREDENTIALS)
    server.start()
    clients = [ControlClient(*server.address, rank=r, timeout=10, credentials=CREDENTIALS) for r in range(3)]
    config = SessionConfig(3, make_policy("random", 3, 2).spec(), timeout=10)
    opened = [client.open_session(1, config) for client in clients]
    yield opened
    for session in opened:  # (an open session whose plane goes away ends its process after a grace)
        session.close()
    for client in clients:
        client.close()
    server.close()


def train(sampler: ShardQueueSampler, reader: ShardReader, trained: list, stop_after: int | None = None) -> None:
    """Drive `sampler` as the loader and the trainer do: read, take, train, report."""
    for read in sampler:
        batch = sampler.take(reader[read])
        if batch is None:
            continue
        if stop_after is not None and len(trained) >= stop_after:
            return  # (lost with this batch read and not trained)
        trained.extend(batch)
        sampler.trained(sampler.untrained.popleft())


def identity(rows):
    return list(rows)


def train_together(samplers: dict[int, ShardQueueSampler], reader: ShardReader) -> tuple[Counter, dict[int, list]]:
    """Each rank's `train` in a thread of its own (a claim at the queue's end waits for the others);
    every sample they trained, counted."""
    trained: dict[int, list] = {rank: [] for rank in samplers}
    threads = [threading.Thread(target=train, args=(samplers[r], reader, trained[r])) for r in samplers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return Counter(row for rows in trained.values() for row in rows), trained


def test_every_sample_once_and_a_lost_ranks_shard_goes_on_from_its_reported_position(sessions):
    files = Files([10, 7, 13, 4, 9, 11])
    reader = ShardReader(ProtocolSource(files), identity)
    samplers = [ShardQueueSampler(files.num_shards, 4, r, 3, s.counters, slow_ratio=0) for r, s in enumerate(sessions)]
    lost: list = []
    train(samplers[2], reader, lost, stop_after=4)  # one batch of its shard trained, the next read
    sessions[2].close(failed=True)  # lost: its shard goes back to the queue at position 4
    everything, _ = train_together({0: samplers[0], 1: samplers[1]}, reader)
    everything.update(lost)
    expected = {(shard, i) for shard, length in enumerate(files.lengths) for i in range(length)}
    assert set(everything) == expected and max(everything.values()) == 1, everything
    assert lost == [(2, i) for i in range(4)]
    assert (2, 4) in files.opened  # read on from where rank 2 stood, not from the start


def test_a_slot_per_worker_process_reads_its_shard_straight_on():
    """With two worker processes, reads alternate between two shards (one per slot), so each worker's
    open iterator goes on; a read past a shard's end gives no batch and the slot takes the next shard."""
    files = Files([6, 6, 6, 6])

    class Store:  # a plain counter: shards 2 and 3 are the queue's
        value = 0

        def add(self, key, amount):
            self.value += amount
            return self.value

    sampler = ShardQueueSampler(4, 4, 0, 2, Store(), slots=2, slow_ratio=0)
    reader = ShardReader(ProtocolSource(files), identity)
    reads: list[ShardRead] = []
    rows: list = []
    for read in sampler:
        reads.append(read)
        batch = sampler.take(reader[read])
        if batch is not None:
            rows.extend(batch)
            sampler.trained(sampler.untrained.popleft())
    assert sorted(rows) == sorted((s, i) for s in (0, 2, 3) for i in range(6))  # (shard 1 is the other rank's)
    # while both slots read, they alternate, each on its shard (worker w gets every w-th read)
    assert [(r.slot, r.shard, r.start) for r in reads[:4]] == [(0, 0, 0), (1, 2, 0), (0, 0, 4), (1, 2, 4)]
    # each shard was opened once: the second reads went on with the iterators their slots had open
    assert files.opened == [(0, 0), (2, 0), (3, 0)]


def test_fewer_shards_than_workers_is_refused_by_name():
    with pytest.raises(ConfigurationError, match="2 shard"):
        ShardQueueSampler(2, 4, 0, 3, object())


def test_a_stream_is_recognised_by_what_it_has(tmp_path):
    datasets = pytest.importorskip("datasets")
    for shard in range(3):
        (tmp_path / f"s{shard}.jsonl").write_text("".join(f'{{"id": {shard * 10 + i}}}\n' for i in range(5)))
    stream = datasets.load_dataset(
        "json", data_files=sorted(str(p) for p in tmp_path.glob("*.jsonl")), split="train", streaming=True
    )
    source = shard_source(stream)
    assert isinstance(source, HuggingFaceSource) and source.num_shards == 3
    assert [row["id"] for row in source.iter_shard(1, 3)] == [13, 14]
    assert isinstance(shard_source(Files([1, 2])), ProtocolSource)
    assert shard_source([1, 2, 3]) is None


def test_a_resumed_epoch_reads_the_shards_in_progress_from_their_positions_then_the_queue(sessions):
    """A checkpoint said: shards before the cursor (6) were trained to their ends but 3 and 4, in progress
    at positions 5 and 2. The resumed fit (two ranks now) reads 3 and 4 on from there, each rank one, then
    shards 6 and 7 from the queue: every sample the first fit had not trained, once."""
    files = Files([8] * 8)
    reader = ShardReader(ProtocolSource(files), identity)
    samplers = [ShardQueueSampler(8, 4, r, 3, s.counters, slow_ratio=0) for r, s in enumerate(sessions[:2])]
    for sampler in samplers:
        sampler.set_members([0, 1])
        sampler.resume_shards(0, 6, [[3, 5], [4, 2]])
    sessions[2].close()  # (not in the resumed fit)
    everything, trained = train_together({0: samplers[0], 1: samplers[1]}, reader)
    expected = {(3, i) for i in range(5, 8)} | {(4, i) for i in range(2, 8)}
    expected |= {(s, i) for s in (6, 7) for i in range(8)}
    assert set(everything) == expected and max(everything.values()) == 1, everything
    assert trained[0][0] == (3, 5) and trained[1][0] == (4, 2)
    assert (3, 5) in files.opened and (4, 2) in files.opened


def test_the_positions_a_rank_reports_are_where_its_shards_were_trained_to():
    files = Files([10, 10, 10])

    class Store:
        value = 0

        def add(self, key, amount):
            self.value += amount
            return self.value

    sampler = ShardQueueSampler(3, 4, 0, 2, Store(), slow_ratio=0)
    reader = ShardReader(ProtocolSource(files), identity)
    reads = iter(sampler)
    sampler.take(reader[next(reads)])  # rows 0-3 of shard 0, handed to the trainer
    assert sampler.positions() == [[0, 0]]  # held, nothing trained yet
    sampler.trained(sampler.untrained.popleft())
    sampler.take(reader[next(reads)])  # rows 4-7, not trained: a checkpoint resumes at 4
    assert sampler.positions() == [[0, 4]] and sampler.held() == [0]


def test_a_stream_read_as_written_keeps_its_loaders_own_position_in_the_checkpoint():
    """A stream without shards is each rank's own: its loader's state (a `StatefulDataLoader`'s position)
    goes into the checkpoint next to global progress, and back into the loader on resume, instead of being
    replaced by it."""
    from lightning_prague.core.data.progress import ProgressCounter
    from lightning_prague.core.data.progress_loader import ProgressLoader

    class Stateful(list):
        restored = None

        def state_dict(self):
            return {"position": 17}

        def load_state_dict(self, state):
            self.restored = state

    loader = Stateful([1, 2, 3])
    progress = ProgressLoader(loader, ProgressCounter(store=None, timeout=1.0), lambda: 0)
    state = progress.state_dict()
    assert state["loader"] == {"position": 17} and state["progress"] == 0
    resumed = ProgressLoader(Stateful([1, 2, 3]), ProgressCounter(store=None, timeout=1.0), lambda: 0)
    resumed.load_state_dict(state)
    assert resumed.loader.restored == {"position": 17}


def test_the_demo_text_as_a_sharded_stream_covers_every_window_once():
    """The text LM's `--streaming` corpus (`CharShards`): our protocol, its shards cover every window
    of the text once, and a shard read from a position goes on where a whole read would be."""
    import torch

    from lightning_prague.demo.textlm import CharShards

    stream = CharShards(torch.arange(1001), context=10, num_shards=7)
    assert isinstance(shard_source(stream), ProtocolSource) and stream.num_shards == 7
    firsts = [int(x[0]) for shard in range(7) for x, _ in stream.iter_shard(shard, 0)]
    assert firsts == [10 * i for i in range(100)]  # every window, once, in order
    whole = [int(x[0]) for x, _ in stream.iter_shard(3, 0)]
    assert [int(x[0]) for x, _ in stream.iter_shard(3, 4)] == whole[4:]
    assert len(list(stream)) == 100  # (no process group: iterated whole, every shard)


def _litdata_item(i: int) -> dict:
    return {"id": i, "x": [float(i)] * 4}


def test_a_litdata_streaming_dataset_is_read_chunk_by_chunk_from_any_position(tmp_path):
    """`litdata.optimize` output, read as a `StreamingDataset`: its chunks are the shards (7 here: six of
    16 samples and one of 4), each read from any position; read through the work queue's reader, every
    sample once."""
    litdata = pytest.importorskip("litdata")
    litdata.optimize(
        fn=_litdata_item, inputs=list(range(100)), output_dir=str(tmp_path / "optimized"), chunk_size=16, num_workers=1
    )
    stream = litdata.StreamingDataset(str(tmp_path / "optimized"))
    source = shard_source(stream)
    assert source is not None and source.num_shards == 7
    assert [item["id"] for item in source.iter_shard(1, 5)] == list(range(21, 32))
    reader = ShardReader(source, identity)
    ids = [item["id"] for shard in range(7) for item in reader[ShardRead(0, shard, 0, 16)].batch]
    assert ids == list(range(100))


def test_a_stream_already_split_by_node_is_read_as_written_with_a_warning(tmp_path):
    """`split_dataset_by_node` marks a Hugging Face dataset (its `_distributed`, a private attribute of
    `datasets`: this test notices if it goes away). Such a stream is each rank's own part: the strategy
    does not share it out, and says what that loses; the whole dataset is shared out."""
    datasets = pytest.importorskip("datasets")
    from types import SimpleNamespace

    from datasets.distributed import split_dataset_by_node
    from torch.utils.data import DataLoader

    from lightning_prague.strategies.loaders import StrategyLoaders

    for shard in range(4):
        (tmp_path / f"s{shard}.jsonl").write_text('{"id": 1}\n')
    files = sorted(str(p) for p in tmp_path.glob("*.jsonl"))
    whole = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    loaders = StrategyLoaders(SimpleNamespace(strategy_name="prague"))  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="already split by node"):
        assert loaders.stream_source(DataLoader(split_dataset_by_node(whole, 0, 2), batch_size=2)) is None
    assert isinstance(loaders.stream_source(DataLoader(whole, batch_size=2)), HuggingFaceSource)
    with pytest.warns(UserWarning, match="has no shards the strategy can share out"):
        assert loaders.stream_source(DataLoader(IterableRange(), batch_size=2)) is None


class IterableRange(IterableDataset):
    """A stream with no shards."""

    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize(
    "positions",
    [[[3]], [[3, 5, 7]], [["3", 5]], [[3, -1]], [[3, 2**63]], [[3.5, 1]], "3:5", [[3, 5]] * ((1 << 16) + 1)],
)
def test_a_meeting_report_with_positions_no_rank_would_send_is_refused(positions):
    """`arrive`'s `positions` come off a socket (and the control plane's journal): pairs of shard and
    position, bounded in number; anything else is refused by the same check as every message."""
    from lightning_prague.core.protocol import BadMessage, check_message

    good = {"op": "arrive", "s": 1, "rank": 0, "sync": "progress@8", "positions": [[3, 5], [4, 0]]}
    assert check_message(good) == good
    with pytest.raises(BadMessage):
        check_message({**good, "positions": positions})


@pytest.mark.serial  # rank 0 must stay slow beside the others' threads
def test_a_slow_rank_gives_the_rest_of_its_shard_back_at_the_tail_and_every_sample_is_trained_once(sessions):
    """Rank 0 reads a long shard; ranks 1 and 2 empty the queue and wait at its end. Once the queue ran out,
    rank 0 (slow) gives the rest of its shard back from where its reads stand, after training what it
    read: a waiting rank reads it on from there. Nothing is read twice or skipped."""
    import time

    files = Files([40, 8, 8, 8, 8, 8])
    # each rank its own reader, as in its own process: one shared reader's open iterator would read shard
    # 0 on for a waiting rank without opening it again where rank 0's reads stood
    readers = {r: ShardReader(ProtocolSource(files), identity) for r in range(3)}
    reader = readers[0]
    samplers = {
        r: ShardQueueSampler(files.num_shards, 4, r, 3, s.counters, slow_ratio=2 if r == 0 else 0)
        for r, s in enumerate(sessions)
    }
    trained: dict[int, list] = {1: [], 2: []}
    threads = [threading.Thread(target=train, args=(samplers[r], readers[r], trained[r])) for r in (1, 2)]
    for thread in threads:
        thread.start()
    slow: list = []
    for read in samplers[0]:
        batch = samplers[0].take(reader[read])
        if batch is None:
            continue
        slow.extend(batch)
        samplers[0].trained(samplers[0].untrained.popleft())
        if len(slow) == 8:  # the others emptied the queue meanwhile: they wait at its end
            deadline = time.monotonic() + 20
            while len(trained[1]) + len(trained[2]) < 5 * 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            samplers[0].queue_ran_out(slow=True)
    for thread in threads:
        thread.join(30)
    assert slow == [(0, i) for i in range(8)] and samplers[0].shards_given_back == 1
    everything = Counter(slow + trained[1] + trained[2])
    expected = {(shard, i) for shard, length in enumerate(files.lengths) for i in range(length)}
    assert set(everything) == expected and max(everything.values()) == 1, everything
    assert (0, 8) in files.opened  # read on from where rank 0's reads stood


def test_a_shard_nobody_would_read_is_kept_by_the_slow_rank_and_read_in_a_further_pass(sessions):
    """Rank 0 (slow) would give the rest of its shard back at the queue's end, but nobody claims any more
    (here ranks 1 and 2 closed; in a job, a meeting at a checkpoint boundary released their parked claims
    and they ended their epoch). The control plane refuses the shard: rank 0 keeps it and, once its
    reads ended, reads it on from where it stood in a further pass, then the queue. Before, the shard
    went back to a queue nobody claimed from again, and its rest was never trained."""
    files = Files([24, 8, 8])
    reader = ShardReader(ProtocolSource(files), identity)
    for session in sessions[1:]:
        session.close()
    sampler = ShardQueueSampler(files.num_shards, 4, 0, 3, sessions[0].counters, slow_ratio=2)
    sampler.set_members([0])
    rows: list = []
    passes = 0
    while True:  # as `ProgressLoader` drives it: a further pass while the sampler kept shards
        passes += 1
        for read in sampler:
            batch = sampler.take(reader[read])
            if batch is None:
                continue
            rows.extend(batch)
            sampler.trained(sampler.untrained.popleft())
            if len(rows) == 8:
                sampler.queue_ran_out(slow=True)
        if not sampler.continue_kept():
            break
    everything = Counter(rows)
    expected = {(shard, i) for shard, length in enumerate(files.lengths) for i in range(length)}
    assert set(everything) == expected and max(everything.values()) == 1, everything
    assert passes == 2 and sampler.shards_given_back == 0
    assert rows[:12] == [(0, i) for i in range(12)]  # read on from row 8 of its shard, before the queue


def test_a_rank_that_is_not_slow_reads_its_shard_to_the_end_when_the_queue_runs_out():
    files = Files([12])
    sampler = ShardQueueSampler(1, 4, 0, 1, _Counting(), slow_ratio=2)
    sampler.queue_ran_out(slow=False)
    reader = ShardReader(ProtocolSource(files), identity)
    rows: list = []
    train(sampler, reader, rows)
    assert rows == [(0, i) for i in range(12)] and sampler.shards_given_back == 0


class _Counting:
    value = 0

    def add(self, key, amount):
        self.value += amount
        return self.value
